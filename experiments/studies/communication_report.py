"""The report of `pslab compare --preset communication` (studies/communication.py): the tables per condition, the
verdicts in words with their bootstrap support, the simulated table at many workers, and three figures — test loss
of the global model against bytes moved (sent + received) per worker, against wall-clock time and against samples (one row per
condition; each arm's curve is its first seed's run, the tables give medians over all seeds)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pslab.experiments.studies.communication import SOLID, lower_median as _lower

COND = {"none": "no straggler", "straggler": "one 4x straggler (the last worker)"}


def _f(v: float | None, fmt: str = ".3g") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def table(res: dict[str, list[dict[str, Any]]], verdicts: list[dict[str, Any]], target: float) -> str:
    """One row per arm: medians over seeds (lower median; time to target: a seed that never reached it is slower
    than any that did, '—' if the median seed did not)."""
    by = {v["arm"]: v for v in verdicts}
    ref_b = _lower([r["bytes_per_sample"] for r in res["bsp"]])
    lines = [f"| arm | bytes per sample (sent + received) | × fewer than bsp | time (s) | wait per worker (s) | time to "
             f"{100 * target:g} % (s) | final test loss: median [min, max] | in bsp's band | staleness mean / max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, runs in res.items():
        b = _lower([r["bytes_per_sample"] for r in runs])
        losses = [r["final_test_loss"] for r in runs]
        t_med = _lower([math.inf if r["time_to_target_s"] is None else r["time_to_target_s"] for r in runs])
        v = by.get(arm)
        band = "(reference)" if v is None else ("yes" if v["within_band"] else "**no**")
        lines.append(
            f"| {arm} | {_f(b, '.1f')} B | {_f(ref_b / b if b and ref_b else None, '.1f')} | "
            f"{_f(_lower([r['time_s'] for r in runs]), '.2f')} | "
            f"{_f(_lower([r['wait_s_per_worker'] for r in runs]), '.2f')} | "
            f"{_f(t_med if math.isfinite(t_med) else None, '.2f')} | {_f(_lower(losses), '.3f')} "
            f"[{_f(min(losses), '.3f')}, {_f(max(losses), '.3f')}] | {band} | "
            f"{_f(_lower([r['staleness_mean'] for r in runs]), '.1f')} / "
            f"{_f(_lower([r['staleness_max'] for r in runs]), '.0f')} |")
    return "\n".join(lines)


def verdict_lines(verdicts: list[dict[str, Any]], target: float) -> list[str]:
    """Each arm in words: loss against bsp's band at its byte ratio, then time to target, each with its bootstrap."""
    out = []
    for v in verdicts:
        x = f"{v['fewer_bytes']:.1f}× fewer" if v["fewer_bytes"] and v["fewer_bytes"] >= 1 else (
            f"{1 / v['fewer_bytes']:.1f}× more" if v["fewer_bytes"] else "unknown")
        noise = lambda s: "" if s >= SOLID else " — within seed noise"     # noqa: E731
        share = f"bootstrap {100 * v['within_share']:.0f} %{noise(v['within_share'])}"
        if v["within_band"]:
            loss = (f"reaches bsp's final test loss within the seed band ({v['loss']:.3f} vs {v['ref_loss']:.3f} ± "
                    f"{v['band']:.3f}; {share}), at {x} bytes per sample")
        else:
            loss = (f"ends outside bsp's band: final test loss {v['loss']:.3f} vs {v['ref_loss']:.3f} ± "
                    f"{v['band']:.3f}, {'higher' if v['d_loss'] > 0 else 'lower'} ({share}), at {x} bytes per sample")
        t, tr = v["t_target"], v["ref_t_target"]
        if t is None and tr is None:
            out.append(f"- **{v['arm']}** {loss}; neither it nor bsp reaches {100 * target:g} % on the median seed.")
            continue
        when = (f"reaches {100 * target:g} % in {_f(t, '.2f')} s vs bsp's {_f(tr, '.2f')} s" if t is not None
                else f"does not reach {100 * target:g} % on its median seed (bsp: {_f(tr, '.2f')} s)")
        fast = (f"{'faster' if v['faster'] else 'not faster'} (bootstrap {100 * v['faster_share']:.0f} %"
                f"{noise(v['faster_share'])})")
        out.append(f"- **{v['arm']}** {loss}; {when}: {fast}.")
    return out


def sim_table(sim: list[dict[str, Any]], target: float) -> str:
    lines = [f"| arm | virtual time (s) | bytes per worker (sent + received) | time to {100 * target:g} % (s) | final test loss | "
             "staleness mean / max |", "|---|---|---|---|---|---|"]
    for r in sim:
        lines.append(f"| {r['label']} | {_f(r['time_s'], '.2f')} | "
                     f"{_f((r['bytes_moved_per_worker'] or 0) / 1e6, '.3g')} MB | {_f(r['time_to_target_s'], '.2f')} | "
                     f"{_f(r['final_test_loss'], '.3f')} | {_f(r['staleness_mean'], '.1f')} / "
                     f"{_f(r['staleness_max'], '.0f')} |")
    return "\n".join(lines)


def plots(data: dict[str, Any], out: Path) -> list[Path]:
    """loss_vs_bytes.png (log x), loss_vs_time.png, loss_vs_samples.png: a row per condition, a line per arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pslab.experiments.results.plots import save_figure
    conds = [c for c in ("none", "straggler") if data["results"].get(c)]
    arms = [a["label"] for a in data["arms"]]
    cmap = plt.get_cmap("tab10")
    paths = []
    for key, xlabel, name in (("bytes", "bytes per worker, sent + received (log scale)", "loss_vs_bytes.png"),
                              ("time_s", "wall-clock time (s)", "loss_vs_time.png"),
                              ("samples", "samples (all workers)", "loss_vs_samples.png")):
        fig, axes = plt.subplots(1, len(conds), figsize=(6.2 * len(conds), 4.4), squeeze=False)
        for ax, cond in zip(axes[0], conds):
            for i, arm in enumerate(arms):
                runs = data["results"][cond].get(arm)
                if not runs:
                    continue
                c = runs[0]["curve"]
                xs = [x for x in c[key]]
                if key == "bytes":
                    pts = [(x, y) for x, y in zip(xs, c["loss"]) if x > 0]
                    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    ax.set_xscale("log")
                else:
                    ys = c["loss"]
                ax.plot(xs, ys, "-" if i < 10 else "--", color=cmap(i % 10), label=arm, lw=1.4)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("test loss (global model)")
            ax.set_title(COND[cond], fontsize=10)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, ncol=2)
        paths.append(save_figure(fig, out / name, f"{data['workload']}, {data['workers']} workers, slow link "
                                 f"{data['latency_s'] * 1e3:g} ms / {data['bandwidth_Bps'] / 1e6:g} MB/s"))
    return paths


def write(data: dict[str, Any], out: Path) -> Path:
    out = Path(out)
    target = data["target_acc"]
    K = data["workers"]
    lines = ["# pslab compare --preset communication: synchronise less often, or send less", "",
             f"Workload `{data['workload']}`, {K} workers x {data['steps']} steps, batch {data['batch_size']} per "
             f"worker, optimizer {data['optimizer']}, lr {data['lr']:g} per gradient ({data['lr_rule']} rule, the "
             f"same for every arm, not tuned per arm), seeds {', '.join(map(str, data['seeds']))} (init and batch "
             f"order; the same seeds for every arm). Each worker on its own emulated host; the hosts joined by a "
             f"slow link of {data['latency_s'] * 1e3:g} ms and {data['bandwidth_Bps'] / 1e6:g} MB/s (`[topology]`, "
             "delays injected by the transport). **Held fixed**: model, initial weights, data, batch sequences, "
             "steps per worker, compute per step, lr; only the synchronisation (and, in the second table, one "
             "worker's speed) changes. Loss is the test loss of the global model (for Local SGD / DiLoCo the last "
             "average, for ps-local the shards' θ). Medians over seeds are lower medians; bsp's band is its median "
             "± 2 sd over the seeds. Staleness: updates missed (ssp, asp), local steps since the average "
             "(local-sgd, diloco), pushes missed, in outer steps (ps-local). "
             f"Total time {data['elapsed_s']:.0f} s.", ""]
    for cond, res in data["results"].items():
        if not res:
            continue
        lines += [f"## {COND[cond].capitalize()}", "", table(res, data["verdicts"][cond], target), "",
                  "Verdicts (against bsp on the same seeds; bootstrap = share of seed-resampled replicates in which "
                  f"the comparison of medians comes out the same; below {100 * SOLID:.0f} % it is seed noise):", ""]
        lines += verdict_lines(data["verdicts"][cond], target) + [""]
    if data["sim"]:
        lines += [f"## Simulated at {data['sim_workers']} workers", "",
                  f"Every arm at {data['sim_workers']} workers, one host each, the same link modelled "
                  "(experiments/sim: ring all-reduce 2(N − 1)(latency + M/N/bandwidth), ring all-gather "
                  "(N − 1)(latency + s/bandwidth); a shard's requests queue on its link), seed "
                  f"{data['seeds'][0]}, lr {data['sim_lr']:.3g} per gradient (so that the averaging arms step with "
                  f"the real runs' step lr under the {data['lr_rule']} rule; ssp and asp apply each gradient at "
                  f"{data['sim_lr']:.3g}), virtual time:", "", sim_table(data["sim"], target), ""]
    paths = plots(data, out)
    lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in paths] + [
        "", "Each run's own directory (runs/, sim/) has its bytes table (formula next to count), staleness "
        "histograms and records: `pslab report DIR`."]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
