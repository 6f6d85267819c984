"""`pslab workloads`: the registered workloads (`experiments.workloads.WORKLOADS`), one line each — the names that
`[workload] name`, `--set workload.name=...` and `pslab sweep --models` accept, with what each model and dataset is.
Nothing is loaded (no data package needed)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workloads", help="list the workloads (name, dataset, model) that configs and studies accept")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pslab.experiments.workloads import WORKLOADS
    width = max(len(n) for n in WORKLOADS)
    dwidth = max(len(s.dataset) for s in WORKLOADS.values())
    print(f"{'name':<{width}}  {'dataset':<{dwidth}}  description")
    for name, spec in WORKLOADS.items():
        print(f"{name:<{width}}  {spec.dataset:<{dwidth}}  {spec.description}")
    return 0
