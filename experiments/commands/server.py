"""`pslab server`: run one parameter-server shard in the foreground (one process per shard).

    pslab server --bind tcp://127.0.0.1:5555 --shard 0 --workers 4 --policy ssp:3 --optimizer adam:lr=1e-3 \\
                 --checkpoint-dir ckpt/shard-0 --checkpoint-every 100

Workers connect with `ps.connect([addr0, addr1, ...], worker=w, params=...)`, addresses in shard order, holding the
job's secret: `--secret-file FILE` (mode 0600; created if missing) or PSLAB_JOB_SECRET[_FILE]; with neither, the
server makes one in a fresh 0700 directory and prints the file's path in its start-up line (workers: set
PSLAB_JOB_SECRET_FILE to it; the directory is removed when the server exits).

Ctrl-C (SIGINT) and SIGTERM stop the server after the message at hand and write a final checkpoint when
--checkpoint-dir is set (so a restarted server loses no update); exit status 130 / 143. An unwritable
--checkpoint-dir is refused at start-up (one line, exit status 1). A server killed outright (kill -9, the OOM
killer) cannot remove its doorbell FIFO and shared-memory segments itself: a small sweeper process beside it
(collectives.cleanup.start_sweeper) notices its death through a pipe and removes them, and the secret's folder.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("server", help="run one parameter-server shard (ZeroMQ) until shutdown or idle timeout")
    p.add_argument("--bind", default="tcp://127.0.0.1:0",
                   help="tcp://HOST:PORT (port 0: pick a free one) or ipc://PATH (default: %(default)s)")
    p.add_argument("--shard", type=int, default=0, help="this shard's index (default: 0)")
    p.add_argument("--workers", type=int, required=True, help="number of workers that will connect")
    p.add_argument("--policy", default="asp", help="asp | bsp | ssp:S (Ho et al.: each push applied at once) | ssp-agg:S (each clock averaged into one step) | bsp-backup:B (default: asp)")
    p.add_argument("--optimizer", default="sgd:lr=0.01",
                   help="sgd|momentum|adam[:key=value,...], keys: lr, momentum, betas=B1/B2, eps, weight_decay, "
                        "nesterov, staleness_lr (each gradient's lr is lr / max(tau, 1), Zhang et al. 2016), "
                        "staleness_rule=gradient|mean (mean: the step's lr / mean tau, for comparison), dc_lambda, "
                        "dc_adaptive, dc_decay (default: %(default)s)")
    p.add_argument("--checkpoint-dir", default=None, help="write/resume checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N versions (0: on demand)")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds a pull may wait on the consistency gate before an error reply (0: forever)")
    p.add_argument("--idle-timeout", type=float, default=0.0,
                   help="exit after this many seconds without any message (0: never)")
    p.add_argument("--secret-file", default=None, metavar="FILE",
                   help="the job secret (a 0600 file; created if missing). Default: PSLAB_JOB_SECRET[_FILE], else a "
                        "new one in a 0700 temp directory, its path printed at start-up")
    p.add_argument("--nonfinite", choices=("reject", "skip"), default="reject",
                   help="a push holding NaN/Inf: reject it with an error, or skip it (ack status 'skipped')")
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="CURVE keys (collectives.curve.generate_keys; the same folder on every host): encrypt, and "
                        "admit only clients holding them and the job secret. Required to bind beyond 127.0.0.1")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from pslab.collectives import cleanup
    from pslab.ps.secret_file import server_secret
    from pslab.ps.server import ServerConfig, ShardServer
    torch.set_num_threads(1)
    secret, where, made_dir = server_secret(args.secret_file)
    previous_env = os.environ.get(cleanup.ENV)
    sweeper, traces = None, ""
    try:
        traces = cleanup.make_dir("pslab-server-")     # this process notes its segments here (collectives/cleanup.py)
        sweeper = cleanup.start_sweeper(traces, [made_dir] if made_dir else [])
        os.environ[cleanup.ENV] = traces
        cfg = ServerConfig(bind=args.bind, shard_id=args.shard, num_workers=args.workers, policy=args.policy,
                           optimizer=args.optimizer, checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every, request_timeout=args.request_timeout,
                           idle_timeout=args.idle_timeout, curve_keys_dir=args.curve_keys, secret=secret,
                           nonfinite=args.nonfinite)
        server = ShardServer(cfg)
        address = server.bind()
        restored = (f", resumed from {server.restored_from} (version {server.state.version})"
                    if server.restored_from else "")
        print(f"pslab server: shard {cfg.shard_id} serving {cfg.num_workers} workers on {address} "
              f"[{cfg.policy}, {cfg.spec.to_string()}]{restored}; job secret: {where}", flush=True)
        stopped_by: list[int] = []

        def stop(signum: int, _frame: object) -> None:       # graceful: the loop ends, then the final checkpoint
            stopped_by.append(signum)
            server.request_stop(signal.Signals(signum).name)
        main = threading.current_thread() is threading.main_thread()     # signals reach the main thread only
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            server.serve_forever()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if server.checkpoint_error:
            print(f"pslab server: {server.checkpoint_error}", file=sys.stderr)
        if stopped_by:
            saved = f"; final checkpoint {server.last_checkpoint}" if server.last_checkpoint else ""
            print(f"pslab server: stopped by {signal.Signals(stopped_by[0]).name}{saved}", file=sys.stderr)
            return 128 + stopped_by[0]
        return 0
    finally:
        if previous_env is None:
            os.environ.pop(cleanup.ENV, None)
        else:
            os.environ[cleanup.ENV] = previous_env
        if sweeper is not None:
            sweeper.stdin.close()                # it sweeps what is left (nothing, after a clean stop) and exits
            try:
                sweeper.wait(10)
            except Exception:
                sweeper.kill()
        elif traces:
            cleanup.sweep(traces)
        if made_dir:
            import shutil
            shutil.rmtree(made_dir, ignore_errors=True)
