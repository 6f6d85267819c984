"""A raw DEALER socket speaking (or abusing) the PS protocol, for protocol and fuzz tests."""

from __future__ import annotations

import zmq

from collectives.wire import decode, encode


class Raw:
    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send_frames(self, frames) -> None:
        self.sock.send_multipart(frames, copy=True)

    def request(self, op, tensors=None, *, seq, meta=None, src=0, timeout_ms=10000):
        self.send_frames(encode(op, tensors, seq=seq, src=src, meta=meta or {}))
        return self.recv(timeout_ms)

    def recv(self, timeout_ms=10000):
        if not self.sock.poll(timeout_ms):
            raise TimeoutError("no reply from the server")
        return decode(self.sock.recv_multipart())

    def drain(self) -> int:
        n = 0
        while self.sock.poll(0):
            self.sock.recv_multipart()
            n += 1
        return n

    def close(self) -> None:
        self.sock.close(0)
