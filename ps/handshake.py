"""A client's authenticated DEALER sockets, and the watch on their handshakes while it registers.

Each socket proves its user at the ZeroMQ handshake: PLAIN with credential(job secret, user), or CURVE with the
cluster's public key and the user's role key pair derived from the secret (ps.admission, collectives.auth). A shard that refuses the credential closes the connection during the handshake, and
the request would just time out; so while registering the client also reads each socket's monitor, and the first
"handshake failed" event becomes an AuthenticationError naming the shard (within milliseconds, not at the timeout).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from collectives.curve import load_keys

from .admission import curve_client, plain_client
from .errors import AuthenticationError

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def open_sockets(ctx: zmq.Context, addresses: Sequence[str], user: str, secret: str,
                 curve_keys_dir: str | None) -> tuple[list[zmq.Socket], list[zmq.Socket]]:
    """(DEALER per address, connected and authenticating as `user`; a handshake monitor per socket)."""
    keys = load_keys(curve_keys_dir) if curve_keys_dir else None
    socks: list[zmq.Socket] = []
    monitors: list[zmq.Socket] = []
    try:
        for a in addresses:
            sock = ctx.socket(zmq.DEALER)
            socks.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                curve_client(sock, keys, secret, user)
            else:
                plain_client(sock, secret, user)
            monitors.append(sock.get_monitor_socket(HANDSHAKE_FAILED))
            sock.connect(a)
    except BaseException:
        stop_monitors(socks, monitors)
        for sock in socks:
            sock.close(0)
        raise
    return socks, monitors


def await_handshake(fut: Future, monitors: Sequence[zmq.Socket], addresses: Sequence[str], user: str,
                    timeout: float) -> Any:
    """fut's result; AuthenticationError as soon as a monitor reports that a shard refused the handshake."""
    end = time.monotonic() + timeout
    while not fut.done() and time.monotonic() < end:
        try:
            fut.exception(0.05)
        except TimeoutError:
            pass
        for i, mon in enumerate(monitors):
            if mon.poll(0):
                event = recv_monitor_message(mon)["event"]
                raise AuthenticationError(
                    f"shard {i} ({addresses[i]}) refused this client's credential as {user!r} "
                    f"({zmq.Event(event).name}): is this the job's secret (ServerGroup.secret, PSLAB_JOB_SECRET) "
                    "and a user the shard serves?")
    return fut.result(0)


def stop_monitors(socks: Sequence[zmq.Socket], monitors: Sequence[zmq.Socket]) -> None:
    for sock, mon in zip(socks, monitors):
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon.close(0)
