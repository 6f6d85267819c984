"""One import namespace: the product's four top-level folders install as `pslab.ps`, `pslab.collectives`,
`pslab.parallelism` and `pslab.experiments` (pyproject.toml's package-dir), and nothing imports them by their bare
folder names — a user's own `experiments/` or `ps/` folder must never shadow pslab's."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("ps", "collectives", "parallelism", "experiments")


def test_every_package_folder_is_listed_under_pslab():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {"pslab": "pslab", **{f"pslab.{f}": f for f in FOLDERS}}
    found = {"pslab"} | {"pslab." + ".".join(p.parent.relative_to(ROOT).parts)
                         for f in FOLDERS for p in (ROOT / f).rglob("__init__.py") if "__pycache__" not in p.parts}
    assert set(cfg["packages"]) == found, "pyproject.toml [tool.setuptools] packages must list every package folder"


def _bare_imports(path: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        bad += [f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    return bad


def test_nothing_imports_the_bare_folder_names():
    files = [p for d in (*FOLDERS, "pslab", "tests", "scripts") if (ROOT / d).is_dir()
             for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts]
    assert len(files) > 100
    bad = [b for p in files for b in _bare_imports(p)]
    assert not bad, "import these through pslab (from pslab.X import ...):\n" + "\n".join(bad)


def test_a_users_own_folders_do_not_shadow_pslab(tmp_path):
    """From a folder holding its own `experiments/` and `ps/` packages (each would exit if imported), pslab's
    modules are the ones imported, and the command still starts."""
    for name in ("experiments", "ps"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise SystemExit('the user\\'s {name} was imported')\n")
    code = ("import pslab, pslab.ps, pslab.experiments.cli, pathlib; "
            "print(pathlib.Path(pslab.ps.__file__).resolve().parent.parent, pslab.__version__)")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    where, version = r.stdout.split()
    assert Path(where) in (ROOT, ROOT / "pslab") or "site-packages" in where, where   # editable or installed
    assert version and version != "0+unknown"
    r = subprocess.run([sys.executable, "-m", "pslab", "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage: pslab" in r.stdout, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pslab", "--version"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"pslab {version}", (r.stdout, r.stderr[-2000:])


@pytest.mark.parametrize("bad", ["import ps\n", "from experiments.cli import main\n", "import collectives.wire\n",
                                 "def f():\n    from parallelism import mesh\n"])
def test_the_check_finds_a_bare_import(tmp_path, bad):
    (tmp_path / "m.py").write_text(bad + "from pslab import ps\nfrom . import x\n")
    assert len(_bare_imports(tmp_path / "m.py", tmp_path)) == 1
