"""report.md: a summary table a teacher can put on a slide, the plots, and one line on what each plot shows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pslab.experiments.results.plots import plot_all, run_label

EXPLAIN = {
    "loss_vs_time": "Training loss against wall-clock time. Asynchronous strategies do not wait for the slowest "
                    "worker, so with a straggler their curve falls faster in time; synchronous ones (allreduce, "
                    "ps-bsp, and SSP once the bound is reached) move at the pace of the slowest worker.",
    "loss_vs_updates": "Training loss against the number of gradients applied. Averaging strategies (local, "
                       "allreduce, ps-bsp, ps-ssp-agg) fold the K workers' gradients of a clock into ONE optimizer "
                       "step -- large-batch SGD -- while ASP and SSP apply each gradient as its own step. The "
                       "table's lr column says how the comparison is made fair: under the linear scaling rule "
                       "(default) an averaging step uses K x the per-gradient lr, so each gradient moves the model "
                       "equally far and the curves differ only by what synchronisation does -- staleness (next "
                       "plots), which grows with K and hurts more for deeper models and larger learning rates (see "
                       "`pslab sweep --preset staleness`). With train.lr_rule = none an averaging step uses the "
                       "same lr as one ASP gradient, so it learns K times less per gradient.",
    "loss_vs_epochs": "Training loss against samples seen (gradients applied x batch size, in epochs of the "
                      "training set), the x-axis of Dai et al. and Ho et al.: at the same samples, a strategy that "
                      "averages K gradients per step has made K times fewer optimizer steps, which the linear "
                      "scaling rule (train.lr_rule) compensates by a K times larger step.",
    "test_accuracy": "Test accuracy on held-out data, evaluated periodically during training.",
    "throughput": "Gradients applied per second while all workers are still running (the straggler's solo tail "
                  "after the others have finished is left out). BSP's throughput is capped by the slowest worker; "
                  "ASP's is not.",
    "staleness_hist": "For each update, how many versions the shard had advanced between the worker's read and the "
                      "update being applied. BSP: always 0. ASP with K equal workers: about K − 1. SSP(s) (Ho et al.: one version per "
                      "gradient): at most (K − 1)(2s + 1); ps-ssp-agg:s (one version per clock): at most s.",
    "staleness_per_worker": "The staleness distribution of single workers while all workers still run (a "
                            "straggler's solo tail left out), next to theory: ASP with K equal workers has mean "
                            "K − 1, and with exponential compute times exactly Geometric(1/K), P(τ = k) = "
                            "(1/K)(1 − 1/K)^k; a persistent straggler c times slower sees the others push c times "
                            "each, a spike at c(K − 1), while the fast workers average K − 2 + 1/c; the red line is "
                            "the strategy's bound (experiments/sim/laws.py).",
    "wait_time": "Mean over workers of the time each spent blocked (at the PS consistency gate, or in the "
                 "all-reduce waiting for its peers), transfers included -- the price of synchrony. With a straggler "
                 "it is the fast workers that wait for the slow one.",
    "bytes_per_worker": "Bytes each worker sent plus received over the whole run. A PS worker pushes one gradient "
                        "and pulls one model per step (2 × model bytes). Ring all-reduce moves 2(N−1)/N × model "
                        "bytes each way per step for large tensors; this small model's tensors (≤ 32 KiB each) take "
                        "the one-step direct exchange instead, which sends every peer a copy (N−1 × bytes each "
                        "way), so here all-reduce moves more per worker than the PS. The next column is the "
                        "article's point: every PS byte passes through the server, so a shard carries workers / "
                        "shards times a worker's bytes (it grows with N), while a ring rank carries only its own "
                        "(2(N−1)/N × model bytes, flat in N; `pslab tour ps-vs-ring` sweeps N on a model large "
                        "enough for the ring). On the torch backend gloo runs a ring "
                        "at every size, and its figure is what the kernel counted on its connections, 48-byte "
                        "message headers included.",
    "bytes_by_kind": "Bytes sent per training step, summed over all ranks, by kind of communication: the "
                     "data-parallel gradient all-reduce, ZeRO's reduce-scatter + all-gather, tensor parallelism's "
                     "per-layer activation all-reduces, pipeline boundaries, parameter-server push + pull. Left bar: "
                     "what the backends counted; right (lighter): the textbook formula in the table above; each byte is "
                     "counted once, where it is sent (a PS step: the worker's push and the shard's reply). Tensor "
                     "parallelism talks in every layer, pipeline parallelism only at stage boundaries -- why TP "
                     "stays on the fastest link.",
    "expert_load": "Mixture of experts: for each MoE layer, the token assignments the router sent to each expert "
                   "over the run (training forwards of every rank), admitted (solid) and dropped because the expert "
                   "was full (hatched: more than the capacity C = min(ceil(capacity_factor x top_k x S / experts), S) in one "
                   "sequence). The dashed line is a perfectly balanced router (k x T / E); the Switch load-balancing "
                   "loss (workload.aux_weight) pulls the bars towards it. Under expert parallelism every token "
                   "crosses to its expert's rank and back by all-to-all (bytes in the table above).",
    "failure_timeline": "Each run with failures over time: the world size (membership after each event), "
                        "throughput (applied updates per second over a sliding window) and the training loss with "
                        "test accuracy points; dotted lines mark inject (red), detect (orange), recover (green) and "
                        "join / expel (blue); the grey dashed curves are the same strategy without the failure. "
                        "ps-asp keeps going at once with the survivors; ps-bsp's throughput drops to zero until the "
                        "failure is detected (a kill at once, a hung process after faults.detect_s); allreduce "
                        "stalls, rolls back to its last commit and rebuilds the ring at N - 1 -- the article's point: "
                        "at scale failures are routine, so detection time and what a recovery loses decide how much "
                        "of the cluster's time is spent training.",
}


def bytes_table(runs: list[dict[str, Any]]) -> str:
    """Measured and modelled bytes per step by kind, one row per (run, kind); '' if no run has them."""
    rows = ["| run | kind | measured kB/step | formula kB/step | formula |", "|---|---|---|---|---|"]
    for r in runs:
        for kind, v in ((r.get("summary") or {}).get("bytes_by_kind") or {}).items():
            model = v.get("model_per_step")
            seen = v["measured_per_step"]
            rows.append(f"| {run_label(r)} | {kind} | "
                        f"{_fmt(seen / 1e3) if seen is not None else 'not observable: ' + str(v.get('unobserved_why') or '')} | "
                        f"{_fmt(model / 1e3 if model is not None else None)} | {v.get('formula') or '—'} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def summary_table(runs: list[dict[str, Any]], target_acc: float | None = None) -> str:
    """One row per run. `lr / gradient (step)`: what each gradient moves the model by, and the optimizer step's lr
    (they differ by the number of gradients a step averages, see train.lr_rule); with `target_acc`, the time and
    the samples it took to first reach that test accuracy."""
    from pslab.experiments.results.records import time_to_accuracy
    from pslab.experiments.results.faults import baseline_for, failure_summary
    target = f" | time to {100 * target_acc:g} % (s) | samples to {100 * target_acc:g} %" if target_acc else ""
    faults = any(r.get("events") for r in runs)
    head = ("| run | workers | gradients / optimizer steps | samples | lr / gradient (step) | time (s) | "
            "updates/s (all running)" + target + " | final train loss | test acc (%) | staleness mean / max | "
            "wait per worker (s) | MB per worker | MB at the busiest process |" +
            (" failures | time to detect (s) | time to recover (s) | steps / updates lost | acc vs no-failure "
             "(points) |" if faults else ""))
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in runs:
        s = r.get("summary") or {}
        acc = s.get("final_test_acc")
        w = max(1, s.get("workers") or 1)
        time_s = _fmt(s.get("time_s")) + (" (virtual)" if s.get("simulated") else "")
        lr = (f"{_fmt(s.get('lr_per_gradient'))} ({_fmt(s.get('lr_step'))})" if s.get("lr_step") is not None
              else "—")
        cells = ""
        if target_acc:
            hit = time_to_accuracy(r.get("evals") or [], target_acc)
            b = ((r.get("config") or {}).get("workload") or {}).get("batch_size")
            cells = (f" | {_fmt(hit[0]) if hit else '—' if s.get('timing_only') else 'not reached'} | "
                     f"{_fmt(hit[1] * b) if hit and b else '—'}")
        rows.append(
            f"| {run_label(r)} | {_fmt(s.get('workers'))} | {_fmt(s.get('updates'))} / "
            f"{_fmt(s.get('optimizer_steps'))} | {_fmt(s.get('samples'))} | {lr} | {time_s} | "
            f"{_fmt(s.get('updates_per_s'))}{cells} | {_fmt(s.get('final_train_loss'))} | "
            f"{_fmt(100 * acc if acc is not None else None)} | "
            f"{_fmt(s.get('staleness_mean'), 2)} / {_fmt(s.get('staleness_max'))} | "
            f"{_fmt((s.get('wait_s_total') or 0.0) / w)} | {_fmt((s.get('bytes_per_worker') or 0) / 1e6)} | "
            f"{busiest(r)} |" +
            (_fault_cells(r, runs, failure_summary, baseline_for) if faults else ""))
    return "\n".join(rows)


def busiest(run: dict[str, Any]) -> str:
    """MB through the busiest process over the run: under a parameter server every worker's push and pull passes
    through the shards, so one shard carries workers/shards times a worker's bytes (∝ N: the article's bottleneck);
    a ring or direct all-reduce rank carries its own (a worker's). Labelled by whose it is."""
    s = run.get("summary") or {}
    per = s.get("bytes_per_worker")
    if per is None:
        return "—"
    train = (run.get("config") or {}).get("train") or {}
    strategy = str(train.get("strategy") or s.get("label") or "")
    if strategy.startswith("ps"):
        shards = max(1, int(train.get("shards") or 1))
        return f"{_fmt(per * max(1, s.get('workers') or 1) / shards / 1e6)} (a shard)"
    return f"{_fmt(per / 1e6)} (a rank)"


def _fault_cells(run: dict[str, Any], runs: list[dict[str, Any]], failure_summary: Any, baseline_for: Any) -> str:
    """failures | detect | recover | lost | final acc minus the no-failure run's (percentage points)."""
    if not run.get("events"):
        return " 0 | — | — | — | — |"
    f = failure_summary(run)
    base = baseline_for(run, runs)
    acc = (run.get("summary") or {}).get("final_test_acc")
    bacc = ((base or {}).get("summary") or {}).get("final_test_acc")
    delta = f"{100 * (acc - bacc):+.2f}" if acc is not None and bacc is not None else "—"
    return (f" {f['failures']} | {_fmt(f['detect_s'])} | {_fmt(f['recover_s'])} | "
            f"{_fmt(f['lost_steps'])} / {_fmt(f['lost_updates'])} | {delta} |")


def write_report(runs: list[dict[str, Any]], out: Path, title: str = "pslab comparison",
                 intro: str = "", target_acc: float | None = None, sections: list[str] | None = None,
                 timeline: list[dict[str, Any]] | None = None) -> Path:
    """report.md in `out`: intro, the summary table, `sections` (markdown blocks placed after it), bytes, the
    timeline of the traced runs among `timeline` (default: among `runs`), plots."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_all(runs, out)
    lines = [f"# {title}", ""]
    if intro:
        lines += [intro, ""]
    if any((r.get("summary") or {}).get("timing_only") for r in runs):
        lines += ["Timing-only simulation: no gradients were computed and no optimizer ran -- the consistency gate, "
                  "versions, staleness, compute and network times are the simulator's own (identical to a training "
                  "simulation of the same schedule), but there is no loss or accuracy, so no loss or accuracy "
                  "plot.", ""]
    lines += ["## Summary", "", summary_table(runs, target_acc), ""]
    from pslab.experiments.results.faults import failure_table
    if failure_table(runs):
        lines += ["## Failures", "", "Per injected fault (RUN_DIR/events.jsonl): time from inject to detect (a kill is "
                  "seen by its parent at once, a hung process after faults.detect_s without heartbeats), from "
                  "detect to recover (training going on again), what the recovery lost (all-reduce: steps since "
                  "the last commit; a restarted shard: updates since its checkpoint), and the final accuracy next "
                  "to the same strategy without the failure.", "", failure_table(runs), ""]
    for block in sections or []:
        lines += [block, ""]
    if bytes_table(runs):
        lines += ["## Bytes per step by kind", "", "Bytes sent per training step by all processes (ranks and PS "
                  "shards), each byte counted where it is sent; measured = what the process groups (and the PS "
                  "client) counted, formula = the textbook figure for this layout (experiments/results/bytes.py).",
                  "", bytes_table(runs), ""]
    if any((r.get("summary") or {}).get("simulated") for r in runs):
        lines += ["Runs marked *(virtual)* were simulated: time is virtual seconds from the compute and network "
                  "model, gradients and PS logic are real.", ""]
    lines += _timeline_section(runs if timeline is None else timeline, out)
    if timeline is not None:                  # the traced runs left out of the picture still get their trace.json
        from pslab.experiments.results.timeline import merge
        for r in runs:
            if r not in timeline and (Path(r["path"]) / "trace").is_dir():
                merge(r["path"])
    lines += ["Runs:", ""] + [f"- `{run_label(r)}`: `{r['path']}`" for r in runs] + [""]
    lines += ["## Plots", ""]
    for name, path in plots.items():
        lines += [f"### {name.replace('_', ' ')}", "", EXPLAIN.get(name, ""), "", f"![{name}]({path.name})", ""]
    p = out / "report.md"
    p.write_text("\n".join(lines))
    return p


def _timeline_section(runs: list[dict[str, Any]], out: Path) -> list[str]:
    """Runs made with --trace: their timelines as one picture and the analysis per run (results/timeline.py)."""
    from pslab.experiments.results.gantt import write_gantt
    from pslab.experiments.results.timeline import format_analysis, merge
    traced = [r for r in runs if (Path(r["path"]) / "trace").is_dir()]
    if not traced:
        return []
    lines = ["## Timeline", "", "Traced runs (`--trace`): what every rank and shard did over a few steady steps, and "
             "per track the seconds of compute, communication, exposed communication (not hidden behind compute), "
             "waiting at a PS gate and straggler padding; `RUN_DIR/trace.json` opens in https://ui.perfetto.dev.", ""]
    for r in traced:
        analysis = merge(r["path"])[1]
        lines += [f"`{run_label(r)}`:", "", "```", format_analysis(analysis), "```", ""]
    png = write_gantt([r["path"] for r in traced], out, [run_label(r) for r in traced])
    return lines + [f"![timeline]({png.name})", ""]
