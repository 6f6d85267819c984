"""scripts/gpu_check.py, the prepared GPU check: without CUDA it says so and runs nothing (exit 2); its `--cpu`
self-test runs the same three parts on CPU tensors over gloo with 2 ranks and passes (pslab's DP engine equals DDP,
the collectives equal numpy) — so the script itself is exercised in CI although its GPU verdict is not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the no-GPU message does not apply")
def test_without_cuda_nothing_runs_and_it_says_so(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "nothing was run" in p.stdout
    assert not (tmp_path / "gpu_check.json").exists()


@pytest.mark.timeout(240)
def test_cpu_self_test_passes_every_part(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--sizes", "4K", "64K", "--reps", "1",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=220)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3/3 parts passed" in p.stdout and "Warning" not in p.stderr, p.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ranks"] == 2 and all(v["status"] == "PASS" for v in report["parts"].values())
    dp = next(v for k, v in report["parts"].items() if k.startswith("2"))
    assert dp["result"] < 1e-5
    bench = next(v for k, v in report["parts"].items() if k.startswith("3"))["result"]
    assert [r["bytes"] for r in bench] == [4096, 65536] and all(r["pslab_s"] > 0 and r["raw_s"] > 0 for r in bench)
