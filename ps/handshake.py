"""A client's authenticated DEALER sockets, and the monitors that watch their connections.

Each socket proves its user at the ZeroMQ handshake: PLAIN with credential(job secret, user), or CURVE with the
cluster's public key and the user's role key pair derived from the secret (ps.admission, collectives.auth). A shard
that refuses the credential closes the connection during the handshake, and the request would just time out; so the
client reads each socket's monitor (ps.client, for the socket's life): a "handshake failed" event becomes an
AuthenticationError naming the shard (within milliseconds, not at the timeout), and a "disconnected" event after a
successful handshake means the shard died or restarted (ShardLostError for the requests in flight).
"""

from __future__ import annotations

from typing import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from pslab.collectives.curve import load_keys

from .admission import curve_client, plain_client
from .errors import AuthenticationError
from .protocol import EVENTS, POLLIN

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
WATCHED = HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


SEND_TIMEOUT_MS = 30_000     # a request that cannot even be queued for this long fails (client.py: PSError)


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
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)    # no pipe (a refused handshake redialling): the send
            if keys is not None:                              # fails as a PSError instead of blocking for ever
                curve_client(sock, keys, secret, user)
            else:
                plain_client(sock, secret, user)
            monitors.append(sock.get_monitor_socket(WATCHED))
            sock.connect(a)
    except BaseException:
        stop_monitors(socks, monitors)
        for sock in socks:
            sock.close(0)
        raise
    return socks, monitors


def read_events(monitor: zmq.Socket) -> list[int]:
    """Every event waiting on a socket monitor (non-blocking)."""
    out = []
    while monitor.getsockopt(EVENTS) & POLLIN:     # ~1 us; a poll(0) costs ~25 us (a Poller per call)
        out.append(int(recv_monitor_message(monitor)["event"]))
    return out


def refused(shard: int, address: str, user: str, event: int) -> AuthenticationError:
    """The error of a refused handshake, naming the shard and what to check."""
    return AuthenticationError(
        f"shard {shard} ({address}) refused this client's credential as {user!r} ({zmq.Event(event).name}): is "
        "this the job's secret (ServerGroup.secret, PSLAB_JOB_SECRET) and a user the shard serves?")


def stop_monitors(socks: Sequence[zmq.Socket], monitors: Sequence[zmq.Socket]) -> None:
    for sock, mon in zip(socks, monitors):
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon.close(0)
