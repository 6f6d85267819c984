"""`pslab bench WHAT`: benchmarks, each against a peer in the same run, printing ratios (never run by the tests
except as smoke tests): `collectives.py` (zmq ring collectives vs gloo), `ps.py` (the parameter server vs the
torch.distributed.rpc PS pattern), `dp.py` (the data-parallel engine vs torch DDP), `sim.py` (the timing-only simulator
vs the training-mode one)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a peer's rendezvous: torch rpc, gloo, Ray)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
