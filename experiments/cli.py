"""The `pslab` command (also `python -m pslab`). Each sub-command lives in `experiments/commands/<name>.py` and exposes
`register(subparsers) -> None`, which adds its parser and sets `func=run(args) -> int` as the default.

Errors that derive from a pslab error class become one clear line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

# sub-command modules, in the order `pslab --help` lists them; a missing module is skipped (work in progress)
COMMANDS = ("compare", "run", "sweep", "report", "export", "server", "secret", "schedule", "bench", "workloads",
            "memory", "plan", "trace", "diagnose", "tour")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pslab",
        description="pslab: see the difference between synchronous and asynchronous distributed training.",
    )
    from pslab import __version__
    parser.add_argument("--version", action="version", version=f"pslab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"pslab.experiments.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"pslab.experiments.commands.{name}":
                continue
            raise
        module.register(sub)
    return parser


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # `kill PID` cleans up like Ctrl-C: worker and server processes are stopped


def main(argv: list[str] | None = None) -> int:
    """Run one `pslab` command; returns its exit status. SIGTERM raises KeyboardInterrupt meanwhile (in the main
    thread), and the handler it replaced is back when main returns (so a caller's own, e.g. a test process's, stays)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if main_thread else None
    try:
        return _main(argv)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("pslab: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:     # `pslab ... | head`: the reader left; stop quietly, like other Unix tools
        import os
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())      # so the interpreter's final flush does not raise again
        return 141
    except Exception as e:  # one clear line for errors we raise on purpose; tracebacks for bugs
        from pslab.experiments.errors import is_user_error
        if is_user_error(e):
            print(f"pslab: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
