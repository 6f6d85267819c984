"""The primitive everything depends on: AllReduce — a parameter server against the ring, and the ring's two phases.

Parameter server (the article: "one server receives every GPU's gradients, averages them, and broadcasts the result
back ... its incoming and outgoing traffic scales with the number of workers"). N workers and one server (rank 0,
holding zeros) run zmq's all_reduce(algorithm="root"): gather to the root, sum, send back. Through the server's
network card, per step and gradient of S bytes:

    in  N·S,   out  N·S,   in + out  2·N·S          time ≥ 2·N·S / bw            (∝ N)

Ring-AllReduce ("every GPU sends and receives roughly 2(N−1)/N times the gradient size, regardless of N"): the same
N workers (a sub-group without the server) run the ring, 2(N−1) steps of one S/N chunk each:

    out 2(N−1)/N·S,   in 2(N−1)/N·S  per rank        time ≈ 2(N−1)·(S/(N·bw) + latency) < 2·S/bw

Bytes come from the transport's counters (collectives/traffic.py), exactly. Times come from an EMULATED network
card per rank (collectives/topology.py with `nic=True`): on 2 CPU cores nine processes cannot show a wire's limits,
so every message is delivered when a link of `bw` bytes/s would deliver it — one outgoing and one incoming
serialising link per rank, whatever the peer (per-pair wires, the default, would give the server N links and hide
exactly the bottleneck this claim is about). Regime: bandwidth — S of a few MiB over a 12.5 MB/s link, so the
wire's S/bw (tens of ms) dwarfs the latency and the CPU's memcpy and sums.

The ring's phases ("over N−1 steps each GPU sends one chunk ... reduce-scatter, and after it finishes every GPU
holds one chunk that represents the fully summed value ... then all-gather, another N−1 steps"): zmq's
reduce_scatter and all_gather, counted apart:

    reduce-scatter   N−1 sends of S/N per rank → rank r holds Σ_w x_w[chunk r]        out (N−1)/N·S
    all-gather       N−1 sends of S/N per rank → every rank holds Σ_w x_w             out (N−1)/N·S

Inputs are integer-valued floats, so every summation order gives the same bits and "equals the sum" is exact.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from .core import Context, Figure, Outcome, pyplot, save, Step

LATENCY_S = 50e-6          # the emulated link's latency (a data-centre Ethernet hop)
BANDWIDTH_BPS = 12.5e6     # its bandwidth, bytes/s (100 Mbit/s): the wire, not the 2 cores, sets the time
PS_REPS, RING_REPS = 3, 5  # timed repetitions (the server's times vary by < 1 %, the ring's by a few %)


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def _inputs(n: int, workers: int, seed: int) -> list[Any]:
    """Worker w's integer-valued float32 gradient (exact sums in any order)."""
    import torch
    return [torch.randint(-8, 8, (n,), generator=torch.Generator().manual_seed(seed * 1000 + w)).float()
            for w in range(workers)]


def ps_ring_rank(group: Any, n: int, seed: int) -> dict[str, Any]:
    """One rank of the PS-vs-ring experiment (rank 0 the server, 1..N the workers); see the module docstring."""
    import torch
    torch.set_num_threads(1)
    N, r = group.world_size - 1, group.rank
    ring = group.new_group(list(range(1, N + 1)))          # the workers alone (None on the server)
    xs = _inputs(n, N, seed) if r > 0 else []
    x = xs[r - 1] if r > 0 else torch.zeros(n)
    total = torch.stack(xs).sum(0) if r > 0 else None
    out: dict[str, Any] = {"rank": r, "ps_s": [], "ring_s": [], "ps_sent": [], "ps_recv": [], "ring_sent": [],
                           "ring_recv": [], "err": 0.0}

    def once(pattern: str, record: bool) -> None:
        buf = x.clone()
        g = group if pattern == "ps" else ring
        group.barrier()
        if g is None:                                       # the server sits out the workers' ring
            return
        before = g.traffic()
        t0 = time.perf_counter()
        g.all_reduce(buf, algorithm="root" if pattern == "ps" else "ring")
        dt = time.perf_counter() - t0
        after = g.traffic()
        if r > 0:
            out["err"] = max(out["err"], float((buf - total).abs().max()))
        if record:
            out[f"{pattern}_s"].append(dt)
            out[f"{pattern}_sent"].append(after["sent_total"] - before["sent_total"])
            out[f"{pattern}_recv"].append(after["recv_total"] - before["recv_total"])

    once("ring", False)                                     # the ring's shared-memory outboxes (the first
    for rep in range(max(PS_REPS, RING_REPS)):              # barrier connected every pair)
        for pattern in (("ps", "ring") if rep % 2 == 0 else ("ring", "ps")):
            if rep < (PS_REPS if pattern == "ps" else RING_REPS):
                once(pattern, True)
    group.barrier()
    return out


def _ps_ring(N: int, n: int, seed: int) -> dict[str, Any]:
    """Launch N workers + 1 server on emulated hosts; per pattern: median step time (max over ranks per repetition),
    the server's bytes in and out, the busiest ring rank's bytes out and in, the largest error against the sum."""
    from pslab import collectives
    from pslab.collectives.topology import Topology
    topo = Topology(hosts=N + 1, per_host=1, inter_latency_s=LATENCY_S, inter_bandwidth_Bps=BANDWIDTH_BPS, nic=True)
    res = collectives.launch(ps_ring_rank, world_size=N + 1, backend="zmq", args=(n, seed), timeout=120,
                             start_method="fork", topology=topo)
    workers = [q for q in res if q["rank"] > 0]

    def step_time(key: str, ranks: list[dict]) -> float:
        return statistics.median(max(q[key][i] for q in ranks) for i in range(len(ranks[-1][key])))
    return {"N": N, "ps_s": step_time("ps_s", res), "ring_s": step_time("ring_s", workers),
            "server_in": max(res[0]["ps_recv"]), "server_out": max(res[0]["ps_sent"]),
            "ring_out": max(max(q["ring_sent"]) for q in workers), "ring_in": max(max(q["ring_recv"]) for q in workers),
            "ring_out_min": min(min(q["ring_sent"]) for q in workers), "err": max(q["err"] for q in workers)}


def ps_vs_ring(ctx: Context) -> Outcome:
    Ns = [2, 4] if ctx.quick else [2, 4, 8]
    n = (1 << 18) if ctx.quick else (1 << 19)               # float32: 1 MiB / 2 MiB of gradient
    S = 4 * n
    rows = []
    for N in Ns:
        ctx.say(f"    N = {N}: parameter server and ring over an emulated {BANDWIDTH_BPS / 1e6:g} MB/s card")
        rows.append(_ps_ring(N, n, ctx.seed))
    if any(q["err"] for q in rows):
        raise RuntimeError(f"an all-reduce did not return the sum: max error {max(q['err'] for q in rows)}")
    lo, hi = rows[0], rows[-1]
    bw, lat = BANDWIDTH_BPS, LATENCY_S
    ps_model = lambda N: 2 * N * S / bw + 2 * lat                       # noqa: E731
    ring_model = lambda N: 2 * (N - 1) * (S / N / bw + lat)             # noqa: E731
    figs = []
    for q in rows:
        N = q["N"]
        figs.append(Figure(f"PS server bytes in+out, N={N}", q["server_in"] + q["server_out"], 2 * N * S, "B/step",
                           "=", 0.0, f"server's counters (in {q['server_in']:,} + out {q['server_out']:,}); 2·N·S, "
                                     f"S = {S:,} B"))
    for q in rows:
        N = q["N"]
        figs.append(Figure(f"ring rank bytes out, N={N}", q["ring_out"], 2 * (N - 1) / N * S, "B/step", "=", 0.0,
                           f"busiest rank's counter (least: {q['ring_out_min']:,}; in: {q['ring_in']:,}); "
                           f"2(N−1)/N·S"))
    figs += [
        Figure(f"PS step time N={hi['N']} ÷ N={lo['N']} (emulated link)", hi["ps_s"] / lo["ps_s"], ps_model(hi["N"]) / ps_model(lo["N"]),
               "×", "=", 0.25, f"medians of {PS_REPS} (max over ranks) vs 2·N·S/bw: {hi['N']}/{lo['N']}", timed=True),
        Figure(f"ring step time N={hi['N']} ÷ N={lo['N']} (emulated link)", hi["ring_s"] / lo["ring_s"],
               ring_model(hi["N"]) / ring_model(lo["N"]), "×", "=", 0.25,
               f"medians of {RING_REPS} vs 2(N−1)·(S/(N·bw) + latency): grows only as 2(N−1)/N → 2", timed=True),
        Figure(f"PS step time, N={hi['N']} (emulated link)", hi["ps_s"] * 1e3, ps_model(hi["N"]) * 1e3, "ms", "=", 0.25,
               f"median vs the link model 2·N·S/bw + 2·latency (bw {bw / 1e6:g} MB/s)", timed=True),
        Figure(f"ring step time, N={hi['N']} (emulated link)", hi["ring_s"] * 1e3, ring_model(hi["N"]) * 1e3, "ms", "=", 0.25,
               f"median vs the link model 2(N−1)·(S/(N·bw) + latency), latency {lat * 1e6:g} µs", timed=True),
    ]
    pic = _draw_ps_ring(ctx.picture("ps-vs-ring"), rows, S, ps_model, ring_model)
    return Outcome(
        figures=figs,
        explanation=(
            f"N workers all-reduce a {_size(S)} gradient, through a parameter server (one more process: "
            f"gather, sum, send back) and around a ring, every process behind one emulated {bw / 1e6:g} MB/s network "
            f"card. The counters show the bottleneck the article describes: the server takes in N·S and sends out "
            f"N·S, {2 * lo['N']}·S at N={lo['N']} and {2 * hi['N']}·S at N={hi['N']} — linear in N — while a ring "
            f"rank sends 2(N−1)/N·S (and receives as much), {2 * (lo['N'] - 1) / lo['N']:.3g}·S to "
            f"{2 * (hi['N'] - 1) / hi['N']:.3g}·S, never 2·S. Time follows the bytes on the busiest card: the "
            f"server's step grew {hi['ps_s'] / lo['ps_s']:.2f}× from N={lo['N']} to N={hi['N']} "
            f"({lo['ps_s'] * 1e3:.0f} → {hi['ps_s'] * 1e3:.0f} ms), the ring's {hi['ring_s'] / lo['ring_s']:.2f}× "
            f"({lo['ring_s'] * 1e3:.0f} → {hi['ring_s'] * 1e3:.0f} ms): at N={hi['N']} the ring is "
            f"{hi['ps_s'] / hi['ring_s']:.1f}× faster, and the gap widens as N²/(N−1) — why rings scale to hundreds "
            f"of GPUs where one server collapses."),
        picture=str(pic),
        notes=[f"regime: bandwidth — S = {_size(S)} over an emulated {bw / 1e6:g} MB/s, {lat * 1e6:g} µs "
               f"link per process (one outgoing, one incoming queue: a network card), so S/bw = "
               f"{S / bw * 1e3:.0f} ms dwarfs latency and CPU; real processes and sockets, delivery times emulated",
               f"timing figures: the two ratios and the two step times (medians of {PS_REPS} / {RING_REPS}, each the "
               "slowest rank); the byte figures are counters, exact",
               "the ring does not stay flat: its bytes per rank, and so its time, grow as 2(N−1)/N — 1× at N=2, "
               "1.75× at N=8, bounded by 2× — which is the article's \"regardless of N\" made exact",
               "every all-reduce returned the exact sum (integer-valued inputs)"])


def _draw_ps_ring(path: Any, rows: list[dict], S: int, ps_model: Any, ring_model: Any) -> Any:
    plt = pyplot()
    Ns = [q["N"] for q in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(Ns, [(q["server_in"] + q["server_out"]) / S for q in rows], "o", color="C3", label="PS server in+out (counted)")
    a.plot(Ns, [2 * N for N in Ns], "-", color="C3", alpha=0.5, label="2·N·S")
    a.plot(Ns, [q["ring_out"] / S for q in rows], "s", color="C0", label="ring rank out (counted)")
    a.plot(Ns, [2 * (N - 1) / N for N in Ns], "-", color="C0", alpha=0.5, label="2(N−1)/N·S")
    a.set(xlabel="workers N", ylabel="bytes per step ÷ S", title="bytes through the busiest process", xticks=Ns)
    a.legend(fontsize=8)
    b.plot(Ns, [q["ps_s"] * 1e3 for q in rows], "o", color="C3", label="parameter server (measured)")
    b.plot(Ns, [ps_model(N) * 1e3 for N in Ns], "-", color="C3", alpha=0.5, label="2·N·S/bw")
    b.plot(Ns, [q["ring_s"] * 1e3 for q in rows], "s", color="C0", label="ring (measured)")
    b.plot(Ns, [ring_model(N) * 1e3 for N in Ns], "-", color="C0", alpha=0.5, label="2(N−1)/N·S/bw")
    b.set(xlabel="workers N", ylabel="ms per all-reduce (median)", title="step time, emulated link", xticks=Ns)
    b.legend(fontsize=8)
    return save(fig, path)



def phases_rank(group: Any, n: int, seed: int) -> dict[str, Any]:
    """One rank of the ring-phases experiment: reduce-scatter, then all-gather of its chunk, then (for comparison)
    one ring all-reduce; per call the bytes and messages this rank's counter recorded, and the error against the sum."""
    import torch
    from pslab.collectives import chunk_bounds
    torch.set_num_threads(1)
    N, r = group.world_size, group.rank
    xs = _inputs(n, N, seed)
    total = torch.stack(xs).sum(0)
    a, b = chunk_bounds(n, N)[r]
    out: dict[str, Any] = {"rank": r}

    def counted(name: str, fn: Any) -> None:
        group.barrier()
        s0 = group.traffic()
        fn()
        s1 = group.traffic()
        out[name] = {"sent": s1["sent_total"] - s0["sent_total"], "recv": s1["recv_total"] - s0["recv_total"],
                     "messages": s1["messages"] - s0["messages"]}

    chunk = torch.empty(b - a)
    counted("reduce_scatter", lambda: group.reduce_scatter(chunk, xs[r].clone()))
    out["rs_err"] = float((chunk - total[a:b]).abs().max())
    full = torch.empty(n)
    counted("all_gather", lambda: group.all_gather(full, chunk))
    out["ag_err"] = float((full - total).abs().max())
    buf = xs[r].clone()
    counted("all_reduce", lambda: group.all_reduce(buf, algorithm="ring"))
    out["ar_err"] = float((buf - total).abs().max())
    group.barrier()
    return out


def ring_phases(ctx: Context) -> Outcome:
    from pslab import collectives
    N = 4 if ctx.quick else 8
    n = (1 << 16) if ctx.quick else (1 << 18)
    S = 4 * n
    res = collectives.launch(phases_rank, world_size=N, backend="zmq", args=(n, ctx.seed), timeout=60,
                             start_method="fork")
    per = lambda op, k: [q[op][k] for q in res]                       # noqa: E731
    rs, ag, ar = per("reduce_scatter", "sent"), per("all_gather", "sent"), per("all_reduce", "sent")
    both = [x + y for x, y in zip(rs, ag)]
    msgs = per("reduce_scatter", "messages") + per("all_gather", "messages")
    figs = [
        Figure("reduce-scatter bytes out per rank", max(rs), (N - 1) / N * S, "B", "=", 0.0,
               f"each rank's counter (least {min(rs):,}); (N−1)/N·S, N = {N}, S = {S:,} B"),
        Figure("all-gather bytes out per rank", max(ag), (N - 1) / N * S, "B", "=", 0.0,
               f"each rank's counter (least {min(ag):,}); (N−1)/N·S"),
        Figure("ring all-reduce bytes out per rank", max(ar), 2 * (N - 1) / N * S, "B", "=", 0.0,
               f"a ring all_reduce's counter (the two phases' counters add up to {max(both):,}); 2(N−1)/N·S"),
        Figure("messages per phase per rank", max(msgs), N, "", "=", 0.0,
               f"counter's sends (least {min(msgs)}): N−1 chunk steps + 1 closing empty acknowledgement"),
        Figure("after reduce-scatter: |own chunk − Σ|", max(q["rs_err"] for q in res), 0.0, "", "=", 0.0,
               "rank r's output vs chunk r of the sum of all N inputs, max over ranks and elements"),
        Figure("after all-gather: |buffer − Σ|", max(q["ag_err"] for q in res), 0.0, "", "=", 0.0,
               "every rank's full buffer vs the sum, max over ranks and elements"),
    ]
    pic = _draw_phases(ctx.picture("ring-phases"), rs, ag, N, S)
    return Outcome(
        figures=figs,
        explanation=(
            f"{N} processes each hold a {_size(S)} gradient, cut into {N} chunks. Reduce-scatter: in "
            f"N−1 = {N - 1} steps each rank passes one chunk to its right neighbour and adds the one arriving from "
            f"its left, so every rank sent exactly (N−1)/N·S = {(N - 1) / N * S:,.0f} bytes and ends holding one "
            f"chunk that is the full sum over all {N} ranks (error 0). All-gather: another N−1 steps circulate "
            f"those reduced chunks, again (N−1)/N·S bytes per rank, and every rank ends with the whole sum (error "
            f"0). The two phases together are what a ring all-reduce sends — 2(N−1)/N·S, measured equal — and "
            f"since every rank does the same work, no rank is the bottleneck a parameter server is."),
        picture=str(pic),
        notes=["integer-valued float32 inputs: sums in any order are exact, so 'equals the sum' is bit-exact",
               f"S = {S:,} B, a multiple of 4·N: all chunks equal, so every rank's bytes are equal too; chunk < the "
               "ring's 4 MiB segment, so one message per step"])


def _draw_phases(path: Any, rs: list[int], ag: list[int], N: int, S: int) -> Any:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ranks = list(range(N))
    ax.bar([r - 0.2 for r in ranks], [b / S for b in rs], 0.4, label="reduce-scatter (counted)", color="C0")
    ax.bar([r + 0.2 for r in ranks], [b / S for b in ag], 0.4, label="all-gather (counted)", color="C2")
    ax.axhline((N - 1) / N, color="k", ls="--", lw=1, label="(N−1)/N")
    ax.set(xlabel="rank", ylabel="bytes sent ÷ S", xticks=ranks, ylim=(0, 1.15),
           title=f"ring all-reduce = reduce-scatter + all-gather, N = {N}")
    ax.legend(fontsize=8, loc="lower right")
    return save(fig, path)


STEPS = [
    Step("ps-vs-ring", "The primitive everything depends on: AllReduce",
         "a parameter server's traffic scales with the number of workers; a ring rank sends 2(N−1)/N times the "
         "gradient, regardless of N",
         "pslab compare --strategies allreduce,ps-bsp --no-straggler --set train.workers=8 "
         "--set workload.name=wide-mlp-1m --set train.steps=20", ps_vs_ring, 60),
    Step("ring-phases", "The primitive everything depends on: AllReduce",
         "Ring-AllReduce is reduce-scatter (N−1 steps; each GPU ends with one fully summed chunk) then all-gather "
         "(N−1 steps)",
         "pslab bench collectives --world 2 4 8 --ops reduce_scatter all_gather all_reduce --sizes 1M 4M",
         ring_phases, 30),
]
