"""CURVE keys for the `zmq` backend (ZeroMQ's CurveZMQ: encryption + authentication, via `zmq.auth`).

    collectives.curve.generate_keys("keys/")          # once; copy keys/ to every host of the job
    init_process_group("zmq", curve_keys_dir="keys/", bind_host="10.0.0.5")

Every rank loads `keys/pslab.key_secret`; its PULL socket is a CURVE server that accepts only clients whose public
key is a `*.key` file in the directory. A socket without the keys cannot connect, so it cannot inject messages.
"""

from __future__ import annotations

import ipaddress
import os

import zmq.auth


def generate_keys(keys_dir: str, name: str = "pslab") -> tuple[str, str]:
    """Create `<name>.key` (public) and `<name>.key_secret` in `keys_dir`; returns both paths."""
    os.makedirs(keys_dir, exist_ok=True)
    public, secret = zmq.auth.create_certificates(keys_dir, name)
    os.chmod(secret, 0o600)
    return public, secret


LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps a socket on this machine: exactly one address in 127.0.0.0/8 or ::1, or
    "localhost". Parsed with `ipaddress`, so "127.0.0.1:1;0.0.0.0" (two ZeroMQ endpoints), "127.evil" or a
    wildcard are not loopback."""
    h = host.strip()
    if h == "localhost":
        return True
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def load_keys(keys_dir: str) -> tuple[bytes, bytes]:
    """(public, secret) of `keys_dir/pslab.key_secret`, or a RendezvousError that says how to make one."""
    from .errors import RendezvousError
    path = os.path.join(keys_dir, "pslab.key_secret")
    if not os.path.exists(path):
        raise RendezvousError(f"CURVE key file {path} not found; create one with "
                              f"pslab.collectives.curve.generate_keys({keys_dir!r})")
    pub, sec = zmq.auth.load_certificate(path)
    if sec is None:
        raise RendezvousError(f"{path} holds no secret key")
    return pub, sec


def serve_curve(ctx: zmq.Context, sock: zmq.Socket, keys_dir: str) -> object:
    """Make `sock` (before bind) a CURVE server that admits only clients whose public key is a `*.key` file in
    `keys_dir`; returns the started authenticator (call `.stop()` when the socket closes)."""
    from zmq.auth.thread import ThreadAuthenticator
    pub, sec = load_keys(keys_dir)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys_dir)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_server = sec, pub, True
    return auth


def connect_curve(sock: zmq.Socket, keys: tuple[bytes, bytes]) -> None:
    """Make `sock` (before connect) a CURVE client of a server holding the same cluster key pair (`load_keys`)."""
    pub, sec = keys
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = sec, pub, pub
