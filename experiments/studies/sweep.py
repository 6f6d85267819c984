"""`pslab sweep`: one config knob over several values, with several seeds; every (value, seed) is a full run
(real or simulated), and the report overlays them. The staleness-curve preset lives in `studies/staleness.py`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pslab.experiments.config import RunConfig, apply, parse_override
from pslab.experiments.errors import ConfigError
from pslab.experiments.results.rundir import RunDir
from pslab.experiments.results.report import write_report
from pslab.experiments.runner import execute


def run_knob_sweep(cfg: RunConfig, knob: str, values: list[str], seeds: list[int], out: Path,
                   simulate: bool = False, quiet: bool = False,
                   force: bool = False) -> tuple[Path, list[dict[str, Any]]]:
    if not values:
        raise ConfigError("sweep needs --values, e.g. --knob train.strategy --values ps-bsp,ps-asp")
    runs = []
    rows = []
    for v in values:
        for seed in seeds:
            c = copy.deepcopy(cfg)
            apply(c, parse_override(f"{knob}={v}"), f"--knob {knob}={v}")
            c.workload.seed = seed
            c.validate()
            label = f"{knob.split('.')[-1]}={v} seed={seed}" + (" (simulated)" if simulate else "")
            rd = execute(c, out / "runs", label=label, simulate=simulate, quiet=quiet, force=force)
            run = RunDir(rd.path).load()
            runs.append(run)
            rows.append({"value": v, "seed": seed, "path": str(rd.path), **(run["summary"] or {})})
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps({"knob": knob, "values": values, "seeds": seeds, "runs": rows},
                                               indent=2))
    report = write_report(runs, out, f"pslab sweep: {knob}")
    return report, runs
