"""CURVE keys for the `zmq` backend (ZeroMQ's CurveZMQ: encryption + authentication, via `zmq.auth`).

    collectives.curve.generate_keys("keys/")          # once; copy keys/ to every host of the job
    init_process_group("zmq", curve_keys_dir="keys/", bind_host="10.0.0.5")

Every rank loads `keys/pslab.key_secret`; its PULL socket is a CURVE server that accepts only clients whose public
key is a `*.key` file in the directory. A socket without the keys cannot connect, so it cannot inject messages.
"""

from __future__ import annotations

import os

import zmq.auth


def generate_keys(keys_dir: str, name: str = "pslab") -> tuple[str, str]:
    """Create `<name>.key` (public) and `<name>.key_secret` in `keys_dir`; returns both paths."""
    os.makedirs(keys_dir, exist_ok=True)
    public, secret = zmq.auth.create_certificates(keys_dir, name)
    os.chmod(secret, 0o600)
    return public, secret
