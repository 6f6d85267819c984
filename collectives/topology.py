"""Links of different speeds on one machine: a host topology for a zmq group, emulated in user space.

    topo = Topology(hosts=2, per_host=2, intra_latency_s=10e-6, intra_bandwidth_Bps=2e9,
                    inter_latency_s=200e-6, inter_bandwidth_Bps=100e6)
    collectives.launch(work, world_size=4, backend="zmq", topology=topo)       # or init_process_group(topology=)
    PSLAB_TOPOLOGY='{"hosts": 2, "per_host": 2, "inter_bandwidth_Bps": 1e8}'   # the same under torchrun (JSON)

Placement (`placement`): "packed" (the default, torchrun's packing: consecutive ranks share a node) puts rank r on
emulated host r // per_host; "spread" puts it on host r % hosts (consecutive ranks on different hosts). A mesh puts
tp innermost (consecutive ranks), so packed keeps a tp group inside a host and spread stretches it across hosts.
"explicit" takes the host of every rank from `host_of` (each host holding per_host ranks): a mesh placed by an
axis order (`parallelism.mesh.MeshLayout.hosts_by_order`, `[topology] placement = "tp,dp,pp"`).
A link between two ranks is "intra" (same host: NVLink's role) or "inter" (different hosts: InfiniBand/Ethernet's
role), each with a latency (s) and a bandwidth (bytes/s; null/absent in JSON = infinite). Everything that asks
where a rank is -- the link classes, hierarchical all-reduce's choice of sub-groups -- goes through `host(rank)`
with the rank's global (world) number, so a mesh's sub-groups see the hosts of their own members.

The model (a LogGP-like serialising link per ordered pair of ranks): a message of B bytes from a to b sent at time t
starts when the link a->b is free, occupies it for B / bandwidth, and is delivered latency later:

    start = max(t, busy[a->b]);   busy[a->b] = start + B / bw;   due = busy[a->b] + latency

so back-to-back messages share the bandwidth and a pipeline of segments pays the latency once, as on a wire.
With `nic = True` a rank has ONE network card per link class instead of a private wire to every peer: everything
it sends of a class leaves through one outgoing link (busy[a->*]), and everything it receives of a class enters
through one incoming link, one message at a time (at b: arrive = max(due, in_busy + B / bw); in_busy = arrive).
Then N senders into one rank -- a parameter server's N pushes -- queue at its card and its N replies leave one
after another: the server's traffic, 2·N·S a step, costs 2·N·S / bw, the bottleneck per-pair wires would hide.
The sender stamps `due` (and its total delay `dly`) into the message's header meta (`LinkEmulator.stamp`, on the
send path: it never blocks the sender, like a NIC with deep queues); the receiver does not hand the message to
its caller before `due` (`LinkEmulator.hold`). Both ranks read one clock, `time.monotonic()` (CLOCK_MONOTONIC is
machine-wide on Linux: the emulation is for ranks on one machine); the hold is capped at `dly`, so ranks on
different machines are never held longer than the modelled delay. Sleeps overshoot by the scheduler's wake-up
time (~0.1 ms): an emulated delay is a lower bound, and latencies below that are not resolved.

Bytes of tensor payload per link class are counted by the sender (`LinkEmulator.bytes`, read with `link_bytes`).
The real transport underneath is unchanged (ipc + shared memory between ranks of one machine, whatever their
emulated host): only the time a message becomes visible moves. With no topology, the transport's only cost is one
`is None` check per send and per receive.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from . import jsonfields

ENV = "PSLAB_TOPOLOGY"
LINKS = ("intra", "inter")
PLACEMENTS = ("packed", "spread", "explicit")


class TopologyError(ValueError):
    """A topology that cannot describe the ranks (one line: which field, what it must be)."""


@dataclass(frozen=True)
class Topology:
    """`hosts` x `per_host` ranks; rank r on host r // per_host ("packed") or r % hosts ("spread"). Latencies in
    seconds, bandwidths in bytes/s."""

    hosts: int
    per_host: int
    intra_latency_s: float = 0.0
    intra_bandwidth_Bps: float = math.inf
    inter_latency_s: float = 0.0
    inter_bandwidth_Bps: float = math.inf
    placement: str = "packed"
    host_of: tuple[int, ...] | None = None     # placement "explicit": the host of each rank, in rank order
    nic: bool = False                          # one card per rank and link class (True) or a wire per rank pair

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise TopologyError(f"topology placement must be one of {', '.join(PLACEMENTS)} (packed: rank r on host "
                                f"r // per_host; spread: on host r % hosts; explicit: host_of[r]), got "
                                f"{self.placement!r}")
        if (self.placement == "explicit") != (self.host_of is not None):
            raise TopologyError("topology host_of (a host per rank) goes with placement \"explicit\" and only with it")
        for name in ("hosts", "per_host"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise TopologyError(f"topology {name} must be an integer >= 1, got {v!r}")
        for name in ("intra_latency_s", "inter_latency_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise TopologyError(f"topology {name} must be a finite number of seconds >= 0, got {v!r}")
        for name in ("intra_bandwidth_Bps", "inter_bandwidth_Bps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v <= 0:
                raise TopologyError(f"topology {name} must be a number of bytes/s > 0 (inf: unlimited), got {v!r}")
        if type(self.nic) is not bool:
            raise TopologyError(f"topology nic must be true (one network card per rank) or false (a link per rank "
                                f"pair), got {self.nic!r}")
        if self.host_of is not None:
            if not isinstance(self.host_of, (list, tuple)):
                raise TopologyError(f"topology host_of must be a list of hosts, one per rank; got {self.host_of!r:.40}")
            hosts = tuple(self.host_of)
            if (len(hosts) != self.world_size or any(type(h) is not int for h in hosts)
                    or sorted(hosts) != sorted(h for h in range(self.hosts) for _ in range(self.per_host))):
                raise TopologyError(f"topology host_of must name a host 0..{self.hosts - 1} for each of the "
                                    f"{self.world_size} ranks, {self.per_host} ranks per host; got {list(hosts)!r:.80}")
            object.__setattr__(self, "host_of", hosts)

    @property
    def world_size(self) -> int:
        return self.hosts * self.per_host

    def host(self, rank: int) -> int:
        """The emulated host of global rank `rank`: r // per_host (packed), r % hosts (spread), host_of[r]."""
        if self.host_of is not None:
            return self.host_of[rank]
        return rank // self.per_host if self.placement == "packed" else rank % self.hosts

    def local(self, rank: int) -> int:
        """Rank `rank`'s index among its host's ranks (0..per_host-1)."""
        if self.host_of is not None:
            return self.host_of[:rank].count(self.host_of[rank])
        return rank % self.per_host if self.placement == "packed" else rank // self.hosts

    def ranks_of(self, host: int) -> list[int]:
        """The global ranks on emulated host `host`, in rank order."""
        return [r for r in range(self.world_size) if self.host(r) == host]

    def link(self, a: int, b: int) -> str:
        """'intra' when ranks a and b share a host, else 'inter'."""
        return "intra" if self.host(a) == self.host(b) else "inter"

    def class_params(self, cls: str) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of a link class, "intra" or "inter"."""
        if cls == "intra":
            return self.intra_latency_s, self.intra_bandwidth_Bps
        return self.inter_latency_s, self.inter_bandwidth_Bps

    def params(self, a: int, b: int) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of the link a -> b."""
        return self.class_params(self.link(a, b))

    def delay(self, a: int, b: int, nbytes: int) -> float:
        """latency + bytes / bandwidth of one message on an idle link a -> b."""
        lat, bw = self.params(a, b)
        return lat + nbytes / bw

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise TopologyError(f"topology of {self.hosts} hosts x {self.per_host} ranks = {self.world_size} ranks, "
                                f"but the job has {world_size}; make hosts * per_host equal the world size")

    # ---- JSON (the PSLAB_TOPOLOGY variable; inf is written as null) -------------------------------------------
    def to_json(self) -> str:
        return jsonfields.dumps(self)

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        d = jsonfields.loads(cls, text, "topology", TopologyError)
        missing = [k for k in ("hosts", "per_host") if k not in d]
        if missing:
            raise TopologyError(f"topology JSON needs {' and '.join(missing)}")
        return cls(**d)


def from_env() -> Topology | None:
    """The topology in PSLAB_TOPOLOGY (JSON), or None when unset or empty."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        return Topology.from_json(text)
    except TopologyError as e:
        raise TopologyError(f"{ENV}: {e}") from None


class Link:
    """One direction of one link, the module docstring's model: a message of B bytes handed over at `now` starts
    when the link is free, occupies it for B / bandwidth and is delivered `latency` later."""

    def __init__(self, latency_s: float, bandwidth_Bps: float) -> None:
        if not (latency_s >= 0 and math.isfinite(latency_s)) or not bandwidth_Bps > 0:
            raise ValueError(f"an emulated link needs latency >= 0 s and bandwidth > 0 B/s, got {latency_s}, "
                             f"{bandwidth_Bps}")
        self.latency_s, self.bandwidth_Bps = float(latency_s), float(bandwidth_Bps)
        self.busy = 0.0                                        # when the link is free again

    def due(self, nbytes: int, now: float | None = None) -> float:
        """When a message of `nbytes` handed over `now` (default: now) is delivered; the link's busy time moves on."""
        now = time.monotonic() if now is None else now
        self.busy = max(now, self.busy) + nbytes / self.bandwidth_Bps
        return self.busy + self.latency_s


class LinkEmulator:
    """One rank's outgoing links (one `Link` per destination, or per link class with `nic`), its incoming card
    (`nic`), the delivery holds and the byte counts."""

    def __init__(self, topology: Topology, rank: int, world_size: int) -> None:
        topology.check_world(world_size)
        self.topology, self.rank = topology, rank
        self.links: dict[Any, Link] = {}                       # dst (nic: link class) -> the outgoing link
        self.in_busy = {c: 0.0 for c in LINKS}                 # nic: when this rank's incoming link is free
        self.bytes = {c: 0 for c in LINKS}                     # tensor payload bytes sent per link class
        self.messages = {c: 0 for c in LINKS}
        self.held_s = 0.0                                      # total time receives were held back

    def stamp(self, dst: int, tensors: Any) -> dict[str, Any]:
        """The header fields of a message to `dst` carrying `tensors`, sent now: due (when it may be delivered), dly
        (its modelled delay) and, with `nic`, nb and lc (its bytes and link class, for the receiver's card);
        advances the link's busy clock."""
        nbytes = sum(int(t.nbytes) for t in tensors)
        cls = self.topology.link(self.rank, dst)
        key = cls if self.topology.nic else dst
        link = self.links.get(key)
        if link is None:
            link = self.links[key] = Link(*self.topology.params(self.rank, dst))
        now = time.monotonic()
        due = link.due(nbytes, now)
        self.bytes[cls] += nbytes
        self.messages[cls] += 1
        if self.topology.nic:
            return {"due": due, "dly": due - now, "nb": nbytes, "lc": cls}
        return {"due": due, "dly": due - now}

    def hold(self, header: dict) -> None:
        """Sleep until the message with this header is due (at most its stamped delay)."""
        meta = header.get("meta", {})
        due, dly = meta.get("due"), meta.get("dly")
        if type(due) is not float or type(dly) is not float:
            return
        nb, cls = meta.get("nb"), meta.get("lc")
        if self.topology.nic and type(nb) is int and nb >= 0 and cls in self.in_busy:   # this rank's card
            bw = self.topology.class_params(cls)[1]
            arrive = max(due, self.in_busy[cls] + nb / bw)
            self.in_busy[cls] = arrive
            dly += arrive - due                  # a queue at the card is part of this message's modelled delay
            due = arrive
        wait = min(due - time.monotonic(), dly)
        if wait > 0:
            time.sleep(wait)
            self.held_s += wait

    def snapshot(self) -> dict[str, Any]:
        return {"bytes": dict(self.bytes), "messages": dict(self.messages), "held_s": self.held_s}

    def reset(self) -> None:
        self.bytes = {c: 0 for c in LINKS}
        self.messages = {c: 0 for c in LINKS}
        self.held_s = 0.0


def link_bytes(group: Any) -> dict[str, int]:
    """Tensor bytes this rank has sent per link class ({'intra': .., 'inter': ..}) over the group's transport (all
    its groups and sub-groups together); zeros when the group has no topology."""
    links = getattr(getattr(group, "tr", None), "links", None)
    return dict(links.bytes) if links is not None else {c: 0 for c in LINKS}


def reset_link_bytes(group: Any) -> None:
    links = getattr(getattr(group, "tr", None), "links", None)
    if links is not None:
        links.reset()
