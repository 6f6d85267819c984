"""Arguments several sub-commands share."""

from __future__ import annotations

import argparse


class _TimingOnly(argparse.Action):
    """--timing-only: --simulate plus the override simulate.timing_only=true (so the resolved config records it)."""

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        ns.timing_only = ns.simulate = True
        ns.overrides = list(ns.overrides or []) + ["simulate.timing_only=true"]   # a copy: never the default list


def add_config_args(p: argparse.ArgumentParser, config_required: bool = False) -> None:
    if config_required:
        p.add_argument("config", help="TOML config file, or a shipped example by name (compare_default, 3d, "
                                      "communication_lm, ...: experiments/configs/*.toml)")
    else:
        p.add_argument("--config", default=None,
                       help="TOML config file, or a shipped example by name (e.g. communication_lm); default: "
                            "experiments/configs/compare_default.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one config value, e.g. --set train.workers=8 or --set parallel.tp=2 (repeatable)")
    p.add_argument("--simulate", action="store_true", help="run in the discrete-event simulator (virtual time)")
    p.add_argument("--timing-only", action=_TimingOnly, nargs=0, default=False,
                   help="simulate without gradients or optimizer (implies --simulate; = --set "
                        "simulate.timing_only=true): consistency, staleness, compute and network times only, "
                        "~10^5 updates per second; no loss or accuracy")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.add_argument("--force", action="store_true",
                   help="start more processes than this machine sensibly runs (max(16, 8 x cores): ranks + shards)")
