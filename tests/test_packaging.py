"""One import namespace: the product's four top-level folders install as `pslab.ps`, `pslab.collectives`,
`pslab.parallelism` and `pslab.experiments` (pyproject.toml's package-dir), and nothing imports them by their bare
folder names — a user's own `experiments/` or `ps/` folder must never shadow pslab's."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.long       # builds a wheel, installs it into venvs: ~30 s beside CI's loops (queued early,
                                    # not at the run's tail, where one worker would build alone)
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
    r = subprocess.run([sys.executable, "-m", "pslab", "compare", "--strategies", "local", "--no-straggler",
                        "--noise-seeds", "0", "--set", "train.steps=4", "--set", "train.eval_every=4", "-q",
                        "--out", "out"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and (tmp_path / "out" / "report.md").is_file(), r.stderr[-2000:]


@pytest.mark.parametrize("bad", ["import ps\n", "from experiments.cli import main\n", "import collectives.wire\n",
                                 "def f():\n    from parallelism import mesh\n"])
def test_the_check_finds_a_bare_import(tmp_path, bad):
    (tmp_path / "m.py").write_text(bad + "from pslab import ps\nfrom . import x\n")
    assert len(_bare_imports(tmp_path / "m.py", tmp_path)) == 1


@pytest.mark.timeout(300)
def test_a_built_wheel_holds_the_configs_and_runs_compare_from_anywhere(tmp_path):
    """Build the wheel from a copy of the checkout, install it (not editable) into a folder, and from a folder that
    is not a checkout run `python -m pslab compare` on its default config, which it finds as package data."""
    import shutil
    import zipfile
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for d in ("pslab", *FOLDERS):
        shutil.copytree(ROOT / d, src / d, ignore=skip)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("pslab_distributed-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.name for p in (ROOT / "experiments" / "configs").glob("*.toml")}
    assert {f"pslab/experiments/configs/{c}" for c in configs} <= names and "compare_default.toml" in configs
    assert {"pslab/__init__.py", "pslab/__main__.py", "pslab/ps/server.py", "pslab/collectives/launcher.py",
            "pslab/parallelism/planner.py", "pslab/experiments/commands/compare.py"} <= names
    assert not any(n.split("/")[0] in (*FOLDERS, "tests") for n in names), "a bare top-level package in the wheel"

    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                        str(site), str(wheel)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = ("import pslab; from pslab.experiments.studies.compare import DEFAULT_CONFIG; "
            "print(pslab.__file__); print(DEFAULT_CONFIG)")
    r = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    init, default = r.stdout.split()
    assert Path(init).is_relative_to(site) and Path(default) == site / "pslab/experiments/configs/compare_default.toml"
    r = subprocess.run([sys.executable, "-m", "pslab", "compare", "--strategies", "local,allreduce", "--no-straggler",
                        "--noise-seeds", "0", "--set", "train.steps=4", "--set", "train.eval_every=4", "-q",
                        "--out", str(elsewhere / "out")], cwd=elsewhere, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list((elsewhere / "out").rglob("report.md")), r.stdout[-2000:]
