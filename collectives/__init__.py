"""pslab's communication layer: wire codec, ZeroMQ transport, process groups and ring collectives.

    import collectives

    def work(group, n):                       # runs in every rank
        t = np.ones(n, np.float32)
        group.all_reduce(t, op="sum")         # in place, like torch.distributed
        return float(t[0])

    collectives.launch(work, world_size=4, backend="zmq", args=(1000,), timeout=60)  # -> [4.0, 4.0, 4.0, 4.0]

    group = collectives.init_process_group(backend="zmq")   # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT

This package knows nothing of parameter servers or models.
"""

from .errors import (CollectiveMismatchError, CollectivesError, LaunchError, PeerTimeoutError, RendezvousError,
                     WireError)
from .group import REDUCE_OPS, ProcessGroup, Work, chunk_bounds
from .traffic import TrafficCounter
from .wire import PROTOCOL_VERSION, Message, WireLimits, decode, encode

__all__ = [
    "CollectiveMismatchError", "CollectivesError", "LaunchError", "PeerTimeoutError", "RendezvousError", "WireError",
    "REDUCE_OPS", "ProcessGroup", "Work", "chunk_bounds", "TrafficCounter", "PROTOCOL_VERSION", "Message",
    "WireLimits", "decode", "encode", "init_process_group", "launch",
]


def __getattr__(name: str):  # lazy: keep `import collectives.wire` light
    if name == "init_process_group":
        from .init import init_process_group
        return init_process_group
    if name == "launch":
        from .launcher import launch
        return launch
    raise AttributeError(name)
