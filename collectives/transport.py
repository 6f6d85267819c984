"""Peer-to-peer ZeroMQ transport: every rank binds one PULL socket and keeps one PUSH socket per peer.

Rendezvous goes through a `torch.distributed` store (TCPStore): rank r publishes `addr/r` (its ipc and tcp
endpoints and its host name); a sender connects over ipc:// when both ranks share a host, else over tcp://.

Messages are `collectives.wire` messages. Each carries a routing key in its header meta `k` (a short list, e.g.
[group, seq, step, segment]); the receiver files messages that arrive early under (sender, key) and hands them out
when asked. Sends are zero-copy (`copy=False`): `send` returns a zmq MessageTracker that says when ZeroMQ is done
with the buffer, and `flush()` waits for all of them, so a caller may reuse its buffers afterwards.

Malformed messages (anything `wire.decode_header` rejects, or a sender outside the world) are dropped and counted
in `dropped`; the rank keeps working. Every wait has a timeout that raises `PeerTimeoutError`.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from . import shm, wire
from .curve import connect_curve, load_keys, serve_curve
from .errors import PeerTimeoutError, RendezvousError, WireError

Key = tuple


@dataclass(frozen=True)
class CurveKeys:
    """CURVE encryption + authentication: `keys_dir` holds `pslab.key_secret` (this cluster's key pair, made by
    `collectives.curve.generate_keys`) and the public `*.key` files of every client allowed to connect."""

    keys_dir: str


class Transport:
    """Tagged point-to-point messaging between the `world_size` ranks of one job."""

    def __init__(self, rank: int, world_size: int, store: Any, *, timeout: float = 60.0,
                 bind_host: str = "127.0.0.1", use_ipc: bool = True, curve: CurveKeys | None = None,
                 limits: wire.WireLimits = wire.DEFAULT_LIMITS, use_shm: bool = True) -> None:
        self.rank, self.world_size, self.timeout, self.limits = rank, world_size, timeout, limits
        self.store = store
        self.ctx = zmq.Context(io_threads=1)
        self.dropped = 0
        self.last_drop_reason = ""
        self._pending: dict[tuple[int, Key], wire.Message] = {}
        self.max_pending = 1 << 16
        self._push: dict[int, zmq.Socket] = {}
        self._trackers: list[zmq.MessageTracker] = []
        self._auth = None
        self.use_shm = use_shm and shm.available()
        self._job = uuid.uuid4().hex[:12]
        self._same_host: dict[int, bool] = {}
        self._outbox: dict[int, shm.Outbox] = {}
        self._inbox = shm.Inbox()
        self._curve = load_keys(curve.keys_dir) if curve else None
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.socket_buffer = 4 << 20  # kernel socket buffers: fewer wake-ups per large message
        self.pull.setsockopt(zmq.RCVBUF, self.socket_buffer)
        if curve:
            self._auth = serve_curve(self.ctx, self.pull, curve.keys_dir)
        self.ipc_dir = None
        endpoints = []
        if use_ipc and hasattr(zmq, "IPC_PATH_MAX_LEN"):
            self.ipc_dir = tempfile.mkdtemp(prefix="pslab-")
            ep = f"ipc://{self.ipc_dir}/r{rank}"
            self.pull.bind(ep)
            endpoints.append(ep)
        try:
            port = self.pull.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as e:
            raise RendezvousError(f"rank {rank}: cannot bind tcp://{bind_host}: {e}") from None
        endpoints.append(f"tcp://{bind_host}:{port}")
        self.endpoints = endpoints
        self.host = host_identity()        # equal ids: ipc sockets + shared memory between the two ranks
        store.set(f"addr/{rank}", "|".join([self.host, *endpoints]))

    # ---- sending ------------------------------------------------------------------------------------------------
    def _peer_socket(self, dst: int) -> zmq.Socket:
        sock = self._push.get(dst)
        if sock is None:
            if not 0 <= dst < self.world_size:
                raise ValueError(f"peer rank {dst} is outside the world of {self.world_size} ranks")
            try:
                self.store.wait([f"addr/{dst}"])
                host, *eps = self.store.get(f"addr/{dst}").decode().split("|")
            except Exception as e:
                raise RendezvousError(f"rank {self.rank}: no address published by rank {dst} ({e})") from None
            ipc = [e for e in eps if e.startswith("ipc://")]
            tcp = [e for e in eps if e.startswith("tcp://")]
            self._same_host[dst] = host == self.host
            ep = ipc[0] if ipc and host == self.host else tcp[0]
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.SNDBUF, self.socket_buffer)
            if self._curve:
                connect_curve(sock, self._curve)
            sock.connect(ep)
            self._push[dst] = sock
        return sock

    def send(self, dst: int, op: str, key: Sequence[Any], tensors: Sequence[wire.Tensor] = (), seq: int = 0,
             meta: dict | None = None, mode: str = "zerocopy", shm_offset: int = 0) -> None:
        """Queue a message for `dst`; returns at once.

        mode "copy": ZeroMQ copies the tensors now, the caller may reuse them at once.
        mode "track": zero-copy, and `flush()` waits until ZeroMQ has released the buffers.
        mode "zerocopy": zero-copy and untracked (cheapest); the caller must know by other means that the buffer
        is no longer needed (e.g. the receiver acknowledged it) before writing to it.
        mode "shm": one tensor, written at byte `shm_offset` of the shared-memory outbox for `dst` (see shm.py and
        `shm_reserve`); falls back to "zerocopy" for a peer on another host."""
        m = {"k": list(key)}
        if meta:
            m.update(meta)
        if mode == "shm":
            box = self._outbox.get(dst)
            if box is not None and box.size:
                m["shm"] = box.write(shm_offset, tensors[0])
                self._peer_socket(dst).send_multipart(wire.encode(op, (), seq=seq, src=self.rank, meta=m))
                return
            mode = "zerocopy"
        frames = wire.encode(op, tensors, seq=seq, src=self.rank, meta=m)
        tracker = self._peer_socket(dst).send_multipart(frames, copy=(mode == "copy"), track=(mode == "track"))
        if tracker is not None and not tracker.done:
            self._trackers.append(tracker)

    def shm_reserve(self, dst: int, nbytes: int) -> bool:
        """Between collectives: make `dst`'s outbox hold `nbytes`. False when `dst` is not reachable by shm."""
        if not self.use_shm:
            return False
        self._peer_socket(dst)
        if not self._same_host.get(dst):
            return False
        box = self._outbox.get(dst)
        if box is None:
            box = self._outbox[dst] = shm.Outbox(self._job, self.rank, dst)
        try:
            box.reserve(nbytes)
        except OSError:                      # /dev/shm full: this collective's payloads go through the socket
            return False
        return True

    def flush(self, op: str = "send", seq: int = 0, peer: int = -1) -> None:
        """Wait until ZeroMQ no longer needs any buffer passed to `send`."""
        deadline = time.monotonic() + self.timeout
        for t in self._trackers:
            try:
                t.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                raise PeerTimeoutError(op, seq, peer, self.timeout, "send buffer still held by ZeroMQ") from None
        self._trackers.clear()

    # ---- receiving ----------------------------------------------------------------------------------------------
    def recv(self, src: int, key: Sequence[Any], op: str, seq: int = 0, *,
             check: Callable[[int, dict], None] | None = None) -> wire.Message:
        """Block until the message from `src` with routing key `key` arrives; other arrivals are filed for later.

        `check(sender, header)` is called on every arrival (to spot ranks that run a different collective)."""
        want = (src, tuple(key))
        hit = self._pending.pop(want, None)
        if hit is not None:
            return hit
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.pull.poll(int(remaining * 1000) + 1):
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(op, seq, src, self.timeout)
                continue
            frames = self.pull.recv_multipart(copy=False)
            try:  # validate the whole message on arrival: a bad one is dropped here and never reaches a caller
                h = wire.decode_header(frames[0], self.limits)
                k = h["meta"].get("k")
                if not isinstance(k, list) or not 0 <= h["src"] < self.world_size:
                    raise WireError(f"message without a routing key or from unknown rank {h['src']}")
                msg = wire.decode(frames, self.limits, as_torch=True, header=h)
                if "shm" in h["meta"]:
                    msg.tensors["0"] = self._inbox.view(h["src"], h["meta"]["shm"])
            except WireError as e:
                self.dropped += 1
                self.last_drop_reason = str(e)
                continue
            if check is not None:
                check(h["src"], h)
            got = (h["src"], tuple(k))
            if got == want:
                return msg
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                self.last_drop_reason = f"mailbox full ({self.max_pending} early messages); dropped {got}"
                continue
            self._pending[got] = msg

    def close(self, linger: float = 5.0) -> None:
        """Close all sockets; messages still queued get up to `linger` seconds to reach live peers."""
        for s in self._push.values():
            s.close(int(linger * 1000))
        for box in self._outbox.values():
            box.close()
        self._inbox.close()
        self.pull.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        if self.ipc_dir:
            try:
                for f in os.listdir(self.ipc_dir):
                    os.unlink(os.path.join(self.ipc_dir, f))
                os.rmdir(self.ipc_dir)
            except OSError:
                pass


def host_identity() -> str:
    """Which ranks may use ipc:// and /dev/shm with each other: PSLAB_HOST_ID if set, else the hostname, the boot id,
    and the identities of this process's network namespace, temp directory and /dev/shm (two containers or
    namespaces that share a hostname but not these get different ids, and talk over tcp)."""
    forced = os.environ.get("PSLAB_HOST_ID")
    if forced:
        return forced
    parts = [socket.gethostname()]
    try:
        parts.append(open("/proc/sys/kernel/random/boot_id").read().strip())
    except OSError:
        pass
    for path in ("/proc/self/ns/net", tempfile.gettempdir(), "/dev/shm"):
        try:
            st = os.stat(path)
            parts.append(f"{st.st_dev}.{st.st_ino}")
        except OSError:
            parts.append("-")
    return "/".join(parts).replace("|", "_")


def unique_prefix() -> str:
    return uuid.uuid4().hex[:12]
