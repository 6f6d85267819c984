"""`pslab secret DIR`: the credentials of a job across hosts, made once into a folder every host reads.

    pslab secret ~/pslab-job          # on a file system every host mounts (home, a cluster share)

writes DIR (mode 0700) with
    job_secret      32 random bytes as hex, mode 0600: every process of the job proves membership with it
                    (collectives/auth.py: HMAC-SHA256 credentials per rank, signed store entries)
    keys/           a CURVE key pair (collectives/curve.py, zmq.auth): sockets that bind beyond loopback encrypt and
                    authenticate with it; pslab refuses to bind beyond 127.0.0.1 without it
and prints the environment variables to export in the job script (absolute paths). Each host then adds its own
PSLAB_BIND_HOST (its address on the cluster network). Run it again into a new folder for a new job; an existing
job_secret is never overwritten.
"""

from __future__ import annotations

import argparse
import os
import secrets
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("secret", help="make a multi-host job's secret and CURVE keys in a folder every host reads",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", help="the folder to create (or an empty one); on a file system every host mounts")
    p.set_defaults(func=run)


def make(folder: Path) -> dict[str, str]:
    """Create the job secret and CURVE keys in `folder`; returns the environment variables that name them."""
    from pslab.collectives.curve import generate_keys
    from pslab.experiments.errors import ConfigError
    folder = folder.expanduser().resolve()
    if (folder / "job_secret").exists():
        raise ConfigError(f"{folder / 'job_secret'} exists: a job's secret is never overwritten (use a new folder "
                          "for a new job, or reuse this one as it is)")
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"{folder} exists and is not an empty folder: name a new one")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    fd = os.open(folder / "job_secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    generate_keys(str(folder / "keys"))
    os.chmod(folder / "keys", 0o700)
    return {"PSLAB_JOB_SECRET_FILE": str(folder / "job_secret"), "PSLAB_CURVE_KEYS": str(folder / "keys")}


def run(args: argparse.Namespace) -> int:
    env = make(Path(args.dir))
    print(f"# made {Path(args.dir).expanduser().resolve()}: the job's secret and CURVE keys (owner only)")
    for k, v in env.items():
        print(f"export {k}={v}")
    print("# and on each host: export PSLAB_BIND_HOST=<this host's address on the cluster network>")
    return 0
