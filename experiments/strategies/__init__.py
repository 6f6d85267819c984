"""Real runs: one training loop (`loop.train_worker`) for every strategy, assembled by `build.py` from the
engine seam (Engine.build -> Replica; SyncStrategy.attach / step), launched by `launch.py` (this machine) or
`roles.py` (torchrun / SLURM). `spec.py` parses strategy strings and holds the one optimizer spec; `local.py` and
`ps.py` are the two sync strategies that live here (all-reduce and ZeRO come from `parallelism`)."""
