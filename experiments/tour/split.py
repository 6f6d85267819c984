"""What to split: the data (data parallelism) or the model (tensor parallelism within a layer, pipeline parallelism
across layers).

Data parallelism keeps ONE model (the article: "every replica needs to end up with the same averaged gradient,
otherwise your model copies drift apart and you have N slightly different ones"). N real processes train
`digits-mlp` with the all-reduce strategy; the single-process `local` strategy trains the same model on the
concatenated N·b batch (the reference, strategies/local.py):

    θ_{t+1} = opt(θ_t, (1/N) Σ_w ∇L(θ_t; batch(w, t)))        on every replica, and in the reference

Measured: every replica's loss at every step and rank 0's parameters after training (its engine checkpoint) against
the reference's — equal, bit for bit, since pslab's all-reduce of a tensor ≤ 32 KiB is a direct exchange that sums in
rank order, the order in which the reference accumulates its N gradients. The only communication is the gradient
sync: the counters, read around the whole step (forward, backward and sync), add up to one all-reduce of S bytes
per step — (N−1)·S per rank for that direct exchange (2(N−1)/N·S for a ring, above 32 KiB), N(N−1)·S over the N
ranks. Without the average (N copies, each stepping on its own shard) the copies drift apart.

Tensor vs pipeline parallelism ("tensor parallelism ... communication happens inside every single layer's forward
and backward pass"; "pipeline parallelism ... communication only happens at the boundary between stages"): the
text transformer (L = 2 blocks; A = b·S·d·4 bytes, one block's activation on the step's batch) split over 2
ranks each way:

    TP (T ranks)   per block: an all-reduce after attention and after the MLP, forward (g) and backward (f):
                   4L all-reduces per rank per step, T·4L·AR_T(A) bytes, AR_T(A) = (T−1)·A (direct, A ≤ 32 KiB)
    PP (P stages)  per cut: each micro-batch's activation forward and its gradient back: 2·A bytes in 2m messages
                   (+ a 4-byte loss broadcast and a one-off 64-byte shape header)

so TP/PP bytes = T·4L·(T−1)·A / (2·(P−1)·A) = 8 here, and TP's messages grow with the layers while PP's do not.
"""

from __future__ import annotations

import glob
import tempfile
from pathlib import Path
from typing import Any

from pslab.experiments.config import example_config

from .core import Context, Figure, Modelled, Outcome, pyplot, save, Step

DP_WORKLOAD = "digits-mlp"            # 4,810 parameters = 19,240 B: one direct-exchange all-reduce per step


def _params(run: Any) -> dict[str, Any]:
    """Rank 0's parameters in the run's newest engine checkpoint (faults.checkpoint_every), by tensor name."""
    import torch
    from pslab.collectives.tensorfile import read_tensor_file
    files = sorted(glob.glob(str(Path(run.path) / "checkpoints" / "step-*" / "rank-00000.pslab")))
    if not files:
        raise RuntimeError(f"run {run.path} wrote no engine checkpoint")
    tensors, meta = read_tensor_file(files[-1])
    names = [p["name"] for p in meta["pieces"]]
    return {name: torch.as_tensor(tensors[f"{i}/param"]) for i, name in enumerate(names)}


def _independent_copies(cfg: Any, N: int, steps: int) -> tuple[list[float], list[list[float]]]:
    """N copies of the same initial model, each stepping on its own batches with no averaging (one process): the
    largest parameter difference between any two copies, and each copy's loss, after every step."""
    import torch
    from pslab.experiments.workloads import get_workload
    torch.set_num_threads(1)
    wl = get_workload(cfg.workload.name, N, cfg.workload.batch_size, cfg.workload.seed)
    models = [wl.make_model() for _ in range(N)]
    opts = [torch.optim.SGD(m.parameters(), lr=cfg.train.lr, momentum=cfg.train.momentum) for m in models]
    spread, losses = [], [[] for _ in range(N)]
    for t in range(steps):
        for w, (m, o) in enumerate(zip(models, opts)):
            x, y, _ = wl.batch(w, t)
            o.zero_grad()
            loss = wl.loss(m, x, y)
            loss.backward()
            o.step()
            losses[w].append(loss.item())
        flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in models]
        spread.append(max(float((f - flat[0]).abs().max()) for f in flat))
    return spread, losses


def data_parallel(ctx: Context) -> Outcome:
    from pslab.experiments.api import run as pslab_run
    from pslab.experiments.config import load_config
    from pslab.experiments.studies.compare import DEFAULT_CONFIG
    from pslab.experiments.workloads import get_workload
    from pslab.collectives.zmq_group import SMALL_BYTES

    N, steps = (2, 5) if ctx.quick else (4, 20)
    sets = [f"workload.name={DP_WORKLOAD}", f"workload.seed={ctx.seed}", f"train.workers={N}", f"train.steps={steps}",
            "train.base_step_s=0", "train.eval_every=1000000", f"faults.checkpoint_every={steps}"]
    with tempfile.TemporaryDirectory(prefix="pslab-tour-dp-") as tmp:
        ar = pslab_run(None, set=sets + ["train.strategy=allreduce"], out=tmp, progress=False)
        ref = pslab_run(None, set=sets + ["train.strategy=local"], out=tmp, progress=False)
        theta, theta_ref = _params(ar), _params(ref)
    dtheta = max(float((theta[k] - theta_ref[k]).abs().max()) for k in theta_ref)
    joined = ar.metrics.merge(ref.metrics, on=["worker", "step"], suffixes=("", "_ref"))
    if len(joined) != N * steps:
        raise RuntimeError(f"expected {N * steps} (worker, step) records in both runs, matched {len(joined)}")
    dloss = float((joined["loss"] - joined["loss_ref"]).abs().max())
    kinds = ar.summary["bytes_by_kind"]
    sync = kinds["dp gradient sync"]
    cfg = load_config(DEFAULT_CONFIG, sets + ["train.strategy=local"])
    wl = get_workload(DP_WORKLOAD, N, cfg.workload.batch_size, ctx.seed)
    S = sum(p.numel() * p.element_size() for p in wl.make_model().parameters())
    direct = S <= SMALL_BYTES
    per_rank = (N - 1) * S if direct else 2 * (N - 1) / N * S
    rule = "(N−1)·S each (direct exchange, S ≤ 32 KiB)" if direct else "2(N−1)/N·S each (ring)"
    spread, drift_losses = _independent_copies(cfg, N, steps)
    pic = _draw_dp(ctx.picture("data-parallel"), joined, drift_losses, spread, N)
    return Outcome(
        figures=[
            Figure("max |θ − θ_reference| after training", dtheta, 0.0, "", "=", 0.0,
                   f"rank 0's parameters (engine checkpoint, step {steps}) vs the local reference's on the N·b batch"),
            Figure("max |loss − reference| over every replica", dloss, 0.0, "", "=", 0.0,
                   f"each of the {N} replicas' loss at each of {steps} steps vs the reference's on the same batch"),
            Figure("bytes sent per step, all ranks", sync["measured_per_step"], N * per_rank, "B/step", "=", 0.0,
                   f"dp group counters around the whole step (forward, backward, sync); N ranks × {rule}, S = {S:,} B"),
        ],
        explanation=(
            f"{N} processes each train a full copy of the model on their own shard of the batch; after backward "
            f"they all-reduce the gradient and take the same step. Every replica's loss at every step, and rank "
            f"0's final parameters, equal to the bit those of one process training on the concatenated "
            f"{N}×{cfg.workload.batch_size} batch: one model, not {N}. The communication counters, read around the "
            f"whole step, hold exactly one all-reduce of the {S:,}-byte gradient — nothing moved during forward or "
            f"backward. Skip the average and the copies part ways at once: {N} copies from the same start, each "
            f"stepping on its own shard, differ by up to {spread[-1]:.3g} per parameter after {steps} steps."),
        picture=str(pic),
        notes=[f"without averaging: max |θ_i − θ_j| = {spread[0]:.3g} after 1 step, {spread[-1]:.3g} after {steps} "
               f"(one process, the same SGD lr {cfg.train.lr:g} and momentum {cfg.train.momentum:g} per copy)",
               "bit-exact because pslab sums a ≤ 32 KiB all-reduce in rank order, as the reference accumulates its "
               "gradients; a ring (tensors > 32 KiB, N > 2) sums in another order and would differ by float32 "
               "rounding",
               f"communication kinds counted: {', '.join(kinds)}"])


def _draw_dp(path: Path, joined: Any, drift: list[list[float]], spread: list[float], N: int) -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for w in range(N):
        d = joined[joined["worker"] == w].sort_values("step")
        a.plot(d["step"], d["loss_ref"], "-", color=f"C{w}", lw=1, label=f"reference, batch of worker {w}")
        a.plot(d["step"], d["loss"], "o", color=f"C{w}", ms=4, mfc="none")
        a.plot(range(len(drift[w])), drift[w], ":", color=f"C{w}", lw=1)
    a.set(xlabel="step", ylabel="loss", title="all-reduce replicas (o) on the reference (—); no averaging (⋯)")
    a.legend(fontsize=7)
    b.plot(range(1, len(spread) + 1), spread, "o-", color="C3", label="N copies, no averaging")
    b.axhline(0, color="C0", lw=2, label="all-reduce: replicas = reference (measured 0)")
    b.set(xlabel="step", ylabel="max |θ_i − θ_j|", title="replicas drift apart without the average")
    b.legend(fontsize=8)
    return save(fig, path)


def _axis_run(axis: str, steps: int, seed: int, tmp: str) -> Any:
    from pslab.experiments.api import run as pslab_run
    tp, pp = (2, 1) if axis == "tp" else (1, 2)
    return pslab_run(example_config("transformer_tp.toml"),
                     set=[f"parallel.tp={tp}", f"parallel.pp={pp}", "train.workers=1", f"train.steps={steps}",
                          "train.eval_every=1000000", f"workload.seed={seed}"], out=tmp, progress=False)


def tp_vs_pp(ctx: Context) -> Outcome:
    from pslab.experiments.config import load_config
    from pslab.experiments.workloads import get_workload
    from pslab.collectives.zmq_group import SMALL_BYTES
    from pslab.parallelism.models import Attention

    steps = 3 if ctx.quick else 6
    with tempfile.TemporaryDirectory(prefix="pslab-tour-tp-pp-") as tmp:
        runs = {axis: _axis_run(axis, steps, ctx.seed, tmp) for axis in ("tp", "pp")}
    tp = runs["tp"].summary["bytes_by_kind"]["tp activations"]
    pp = runs["pp"].summary["bytes_by_kind"]["pp boundaries"]
    cfg = load_config(example_config("transformer_tp.toml"), [])
    T = P = 2
    m, b = cfg.parallel.micro_batches, cfg.workload.batch_size
    wl = get_workload("text-transformer", 1, b, ctx.seed)
    model = wl.make_model()
    L = sum(isinstance(x, Attention) for x in model.modules())
    x, _, _ = wl.batch(0, 0)
    d = next(x_ for x_ in model.modules() if isinstance(x_, Attention)).d
    A = x.numel() * d * 4                                  # b·S·d·4 bytes: one block's activation on the batch
    ar = (T - 1) * A if A <= SMALL_BYTES else 2 * (T - 1) / T * A
    ratio = T * 4 * L * ar / (2 * (P - 1) * A)
    tp_msgs = T * 4 * L * ((T - 1) if A <= SMALL_BYTES else 2 * (T - 1))
    pp_msgs = (P - 1) * (2 * m + 1 + 1 / steps)
    pic = _draw_tp_pp(ctx.picture("tp-vs-pp"), tp, pp, L)
    return Outcome(
        figures=[
            Figure("TP bytes per step (2 ranks)", tp["measured_per_step"], tp["model_per_step"], "B/step", "=", 0.0,
                   f"tp group counters vs results/bytes.py: {tp['formula']}"),
            Figure("PP bytes per step (2 stages)", pp["measured_per_step"], pp["model_per_step"], "B/step", "=", 0.0,
                   f"pp group counters vs results/bytes.py: {pp['formula']}"),
            Figure("TP ÷ PP bytes", tp["measured_per_step"] / pp["measured_per_step"], ratio, "×", "=", 0.01,
                   f"counted ratio vs T·4L·(T−1)·A / (2(P−1)·A) = {ratio:g} (L = {L}, A = b·S·d·4 = {A:,} B); PP "
                   f"adds a 4 B loss and a one-off 64 B header: within 1 %"),
            Figure("TP messages per step", tp["sends_per_step"], tp_msgs, "", "=", 0.0,
                   f"counted sends vs T ranks · 4L all-reduces ({L} blocks × attention, MLP × forward, backward) · "
                   f"{'(T−1) direct sends' if A <= SMALL_BYTES else '2(T−1) ring steps'}"),
            Figure("PP messages per step", pp["sends_per_step"], pp_msgs, "", "=", 0.0,
                   f"counted sends vs (P−1) cuts · (2m = {2 * m} micro-batch sends + 1 loss broadcast + 1 shape "
                   f"header / {steps} steps), whatever L"),
        ],
        explanation=(
            f"The same {L}-block transformer split two ways over 2 processes. Tensor parallelism halves every "
            f"attention and MLP matrix, so each block must combine partial results twice forward and twice backward: "
            f"{tp['sends_per_step'] / T / L:g} messages per layer per rank, {tp['measured_per_step']:,.0f} bytes per "
            f"step. Pipeline parallelism gives each process whole blocks and talks only at the one cut: each of the "
            f"{m} micro-batches' activation forward and its gradient back, {pp['measured_per_step']:,.0f} bytes in "
            f"{pp['sends_per_step']:.3g} messages, independent of how many layers a stage holds. TP moved "
            f"{tp['measured_per_step'] / pp['measured_per_step']:.2f}× the bytes in "
            f"{tp['sends_per_step'] / pp['sends_per_step']:.1f}× the messages, every one of them on the critical path "
            f"of a layer — why TP wants NVLink inside a node and PP tolerates the slower links between nodes."),
        modelled=[Modelled("an 80-layer model: TP all-reduces per rank per step", 4 * 80, "",
                           "4L (attention and MLP, forward and backward, per layer): grows with depth"),
                  Modelled("an 80-layer model: PP sends per cut per step", 2 * m, "",
                           f"2m (m = {m} micro-batches, activation and gradient): whatever the depth")],
        picture=str(pic),
        notes=[f"both counted against the formula of experiments/results/bytes.py, exactly; A = {A:,} B ≤ 32 KiB, so "
               "each TP all-reduce is pslab's direct exchange ((T−1)·A per rank; a ring's 2(T−1)/T·A is the same "
               "at T = 2)",
               f"{steps} steps, 1 data-parallel worker: only the split axis communicates"])


def _draw_tp_pp(path: Path, tp: dict, pp: dict, L: int) -> Path:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = ["tensor (T=2)", "pipeline (P=2)"]
    a.bar(names, [tp["measured_per_step"] / 1e3, pp["measured_per_step"] / 1e3], color=["C3", "C0"])
    a.plot(names, [tp["model_per_step"] / 1e3, pp["model_per_step"] / 1e3], "k_", ms=30, label="formula")
    a.set(ylabel="kB per step (all ranks)", title="bytes, counted")
    a.legend(fontsize=8)
    b.bar(names, [tp["sends_per_step"], pp["sends_per_step"]], color=["C3", "C0"])
    b.set(ylabel="messages per step", title=f"messages, counted ({L} layers)")
    return save(fig, path)


STEPS = [
    Step("data-parallel", "Splitting the data: data parallelism",
         "every replica must end with the same averaged gradient, or the copies drift apart: one model, and "
         "communication only at the gradient sync",
         "pslab compare --strategies local,allreduce --no-straggler --set train.workers=4", data_parallel, 30),
    Step("tp-vs-pp", "Splitting the model: model parallelism",
         "tensor parallelism communicates inside every layer's forward and backward; pipeline parallelism only at "
         "stage boundaries",
         "pslab run experiments/configs/transformer_tp.toml --set parallel.tp=1 --set parallel.pp=2", tp_vs_pp, 30),
]
