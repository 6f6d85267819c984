"""The parameter-server protocol on top of the `collectives.wire` codec (msgpack header + raw tensor frames).

Requests (client DEALER -> shard ROUTER); `seq` strictly increases per connection, `src` is the worker id (-1 for
an admin connection). Every connection is authenticated at the handshake (ZeroMQ PLAIN as "worker:<w>" or
"admin", or CURVE); who may send what is in ps.admission (role column):

    register   meta {worker, token?}                          -> ok {version, clock, initialized, keys, shard, policy}
               (worker w only; token: the client's random id, lets the same client re-register on a new connection)
    init       meta {worker} + the shard's tensors (flat)     -> ok {initialized: true}; a second init is an
               (registered worker 0, or admin)                   AlreadyInitializedError
    pull       meta {clock}                                   -> ok {version, clock, committed} + tensors
    push       meta {clock, version} + one gradient per key   -> ok {status, version, clock, staleness}
               (pull and push: as the registered worker only; status "applied" | "buffered" | "dropped" | "skipped")
               with pull: true (push_pull) the shard then reads at the new clock (waiting at the gate like a
               pull) and answers once: ok {status, ..., read: {version, clock, committed}} + tensors
    A compressed push (ps.compression) carries meta {compress: "topk" | "sign", keys: [the shard's keys, in the
    order the payload packs them]} and, instead of one gradient per key, "topk.i" (int32) + "topk.v", or one packed
    uint8 tensor per key + "sign.scale"; the shard decodes (validating everything) before the push proceeds.
    Same-host shared-memory path (shm_path.py): register may carry {shm_probe, shm_token} (-> ok {shm: bool});
    a push may carry meta {shm: [[key, descriptor], ...]} instead of frames; pull/push_pull with shm_reply: true
    are answered with meta {shm: [[key, descriptor], ...]} instead of frames.
    stats      meta {}                                        -> ok {version, clocks, stats, counters}
    checkpoint meta {}           (admin)                      -> ok {path}
    ping       meta {}                                        -> ok {}
    shutdown   meta {}           (admin)                      -> ok {} then the server exits (final checkpoint)
    members    meta {alive: [w...], version} (admin)          -> ok {members, version, committed, clocks}: the
               versioned membership (versions only increase); removed workers' registrations are dropped
    A push ack carries checkpoint_error: "..." while the shard's last periodic checkpoint failed; register and
    stats replies carry the shard's incarnation (random per process: a change means it restarted).
    unregister meta {}                                        -> (no reply) the client is closing: the shard forgets
                                                                 the connection, its shm link and parked reads

Every reply echoes the request's seq; an error reply is op "error" with meta {kind, error} where kind is a
`ps.errors` class name. A malformed message gets an error reply (seq 0 if even the header was unreadable) and
changes nothing. Only pull (and push_pull's read) can wait (parked on the consistency gate or until init);
everything else answers at once. The shard may also send an unsolicited "ok" with seq 0 (a liveness probe of a
quiet connection): clients ignore replies they did not ask for.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import zmq

from pslab.collectives.wire import WireLimits

from .errors import ProtocolError

OPS = frozenset({"register", "unregister", "init", "pull", "push", "stats", "checkpoint", "ping", "shutdown",
                 "members"})
REPLY_OPS = frozenset({"ok", "error"})
ADMIN_OPS = frozenset({"checkpoint", "shutdown", "members"})


def server_limits(max_message_bytes: int = 1 << 31, max_tensors: int = 4096) -> WireLimits:
    """What a shard accepts: only protocol ops, bounded sizes."""
    return WireLimits(max_header_bytes=1 << 20, max_tensors=max_tensors, max_tensor_bytes=max_message_bytes,
                      max_message_bytes=max_message_bytes, allowed_ops=OPS)


CLIENT_LIMITS = WireLimits(max_header_bytes=64 << 20, allowed_ops=REPLY_OPS)


def meta_int(meta: Mapping[str, Any], key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    """meta[key] as an int in [lo, hi], or ProtocolError naming the field."""
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"request field {key!r} must be an integer in [{lo}, {hi}], got {v!r:.60}")
    return v


def meta_list(meta: Mapping[str, Any], key: str, max_len: int = 1 << 20) -> list[Any]:
    """meta[key] as a list of at most `max_len` items, or ProtocolError naming the field."""
    v = meta.get(key)
    if not isinstance(v, list) or len(v) > max_len:
        raise ProtocolError(f"request field {key!r} must be a list (at most {max_len} items), got {type(v).__name__}")
    return v


def wire_safe(obj: Any) -> Any:
    """Make stats msgpack-safe for a strict receiver: string map keys, lists for tuples, None for nan/inf."""
    if isinstance(obj, Mapping):
        return {str(k): wire_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [wire_safe(v) for v in obj]
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    return obj


# zmq constants as plain ints for the per-message paths: pyzmq's enums cost ~1 µs an operation (`&`, flags)
EVENTS, POLLIN, POLLOUT, NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT), int(zmq.NOBLOCK)
