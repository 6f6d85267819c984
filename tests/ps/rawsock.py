"""A raw DEALER socket speaking (or abusing) the PS protocol, for protocol and fuzz tests. It authenticates as
`user` with the job secret (PLAIN), or not at all with `user=None`; `recv` skips the shard's liveness notices."""

from __future__ import annotations

import time

import zmq

from pslab.collectives.wire import decode, encode
from pslab.ps.admission import job_secret, plain_client


class Raw:
    def __init__(self, address: str, user: str | None = "worker:0", secret: str | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 2000)    # a refused handshake leaves no peer to send to
        if user is not None:
            plain_client(self.sock, secret or job_secret(), user)
        self.sock.connect(address)

    def send_frames(self, frames) -> None:
        try:
            self.sock.send_multipart(frames, copy=True)
        except zmq.Again:
            raise TimeoutError("cannot send: no connected server") from None

    def request(self, op, tensors=None, *, seq, meta=None, src=None, timeout_ms=10000):
        if src is None:      # what a well-behaved client sends: its worker id
            src = (meta or {}).get("worker", 0) if op == "register" else getattr(self, "worker", 0)
        if op == "register":
            self.worker = (meta or {}).get("worker", src)
        self.send_frames(encode(op, tensors, seq=seq, src=src, meta=meta or {}))
        return self.recv(timeout_ms)

    def recv(self, timeout_ms=10000):
        end = time.monotonic() + timeout_ms / 1000
        while True:
            left = end - time.monotonic()
            if left <= 0 or not self.sock.poll(left * 1000):
                raise TimeoutError("no reply from the server")
            m = decode(self.sock.recv_multipart())
            if not (m.seq == 0 and m.op == "ok" and "notice" in m.meta):
                return m

    def drain(self) -> int:
        n = 0
        while self.sock.poll(0):
            self.sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        self.sock.close(0)
