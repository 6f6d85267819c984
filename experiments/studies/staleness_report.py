"""Tables, claim checks and the plot of the staleness presets (`staleness.py`), computed from the numbers only.

A cell's value is its normalised cost n = T(s) / T(0); a censored cell is only known to exceed the lower bound
L = max_steps / T(0). Comparing a > b with censoring: both observed -> a > b; a censored, b observed -> true if
L_a > b, else undetermined; a observed, b censored -> false if a < L_b, else undetermined; both censored ->
undetermined. Dai et al.'s claims are checked at every s > 0 of the sweep and reported at the largest s:

1. more staleness costs more steps: T(s) non-decreasing in s in every row (and T(s_max) > T(0));
2. deeper models are more sensitive: n(model_1) < n(model_2) < ... in the order of `models` (shallow -> deep),
   per optimizer;
3. momentum and Adam are more sensitive than SGD on the deep model: n(momentum) > n(sgd), n(adam) > n(sgd);
4. more workers amplify the effect: n(K) > n(K = 1) on the deep model, for every K of `worker_counts`;

and, for a sweep with variants, whether each remedy needs fewer steps than the plain optimizer at the same s
(with the number of seeds on which it does, each cell at its own chosen lr).

Noise: `Bootstrap` resamples the seeds (the same draw for every cell, so comparisons stay paired by seed) and
recomputes every median at the chosen lrs; each comparison at the largest s is quoted with the share of 1,000
replicates in which it holds (near 50 %: within seed noise; the lr choice is not redone, so this understates the
noise a little).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

Cell = dict[str, Any]


def _row_name(c: Cell, many_variants: bool, show_k: bool) -> str:
    name = f"{c['depth']} {c['optimizer']}"
    if many_variants:
        name += f" {c['variant']}"
    return name + (f" K={c['workers']}" if show_k else "")


def _rows(cells: list[Cell]) -> dict[tuple, dict[int, Cell]]:
    out: dict[tuple, dict[int, Cell]] = {}
    for c in cells:
        out.setdefault((c["depth"], c["optimizer"], c["variant"], c["workers"]), {})[c["staleness"]] = c
    return out


def _steps(c: Cell, spec: Any) -> str:
    n, k = len(c["seed_steps"]), c["censored"]
    med = f"> {spec.max_steps}" if c["steps"] is None else f"{c['steps']}"
    return med + (f" ({k}/{n})" if k else "")


def _norm(c: Cell, spec: Any) -> str:
    if c["normalised"] is not None:
        return f"{c['normalised']:.2f}"
    return f"> {c['normalised_lower']:.1f}" if c["normalised_lower"] is not None else "—"


def _lr(c: Cell, spec: Any) -> str:
    return f"{c['lr']:g}" + ("*" if c["lr_edge"] else "")


def tables(cells: list[Cell], spec: Any) -> str:
    """Three markdown tables (median steps with censored seeds, normalised cost, chosen lr) over s."""
    many = len({c["variant"] for c in cells}) > 1
    show_k = len({c["workers"] for c in cells}) > 1 or spec.workers != 1
    rows = _rows(cells)
    head = "| | " + " | ".join(f"s={s}" for s in spec.staleness) + " |\n|---|" + "---|" * len(spec.staleness)
    out = []
    for title, fmt in ((f"median steps to {100 * spec.target_acc:g} % test accuracy over seeds {list(spec.seeds)} "
                        f"(censored seeds / seeds; > {spec.max_steps}: more than half censored)", _steps),
                       ("normalised cost T(s) / T(0)", _norm),
                       ("chosen learning rate (* = at an edge of the widened grid)", _lr)):
        lines = [f"**{title}**", "", head]
        for key, by_s in rows.items():
            any_cell = next(iter(by_s.values()))
            vals = [fmt(by_s[s], spec) if s in by_s else "" for s in spec.staleness]
            lines.append(f"| {_row_name(any_cell, many, show_k)} | " + " | ".join(vals) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _value(c: Cell | None) -> tuple[float, bool] | None:
    if c is None:
        return None
    if c["normalised"] is not None:
        return c["normalised"], False
    return (c["normalised_lower"], True) if c["normalised_lower"] is not None else None


def greater(a: tuple[float, bool] | None, b: tuple[float, bool] | None) -> bool | None:
    """a > b for (value, censored) pairs, a censored value being a lower bound (module docstring); None: unknown."""
    if a is None or b is None:
        return None
    (x, ca), (y, cb) = a, b
    if not ca and not cb:
        return x > y
    if ca and not cb:
        return True if x > y else None
    if not ca and cb:
        return False if x < y else None
    return None


def _verdict(results: list[bool | None]) -> str:
    if not results:
        return "not in this sweep"
    if all(r is True for r in results):
        return "holds"
    if any(r is False for r in results):
        return "fails"
    return "undetermined (censored)"


def _fmt(v: tuple[float, bool] | None) -> str:
    return "—" if v is None else (f"> {v[0]:.1f}" if v[1] else f"{v[0]:.2f}")


class Bootstrap:
    """Seed resampling: B replicates of n seed indices drawn with replacement (the same draw for every cell, so
    comparisons are paired by seed), each cell's lower median recomputed at its chosen lr (the lr choice itself
    is not redone); censored = inf. `share(cond)` = fraction of replicates in which cond holds."""

    def __init__(self, cells: list[Cell], n_seeds: int, replicates: int = 1000, seed: int = 0):
        self.idx = np.random.default_rng(seed).integers(0, n_seeds, (replicates, n_seeds))
        self.rows = _rows(cells)
        self._t: dict[tuple, np.ndarray] = {}

    def steps(self, key: tuple, s: int) -> np.ndarray:
        if (key, s) not in self._t:
            arr = np.array([np.inf if v is None else v for v in self.rows[key][s]["seed_steps"]], float)
            self._t[(key, s)] = np.sort(arr[self.idx], axis=1)[:, (self.idx.shape[1] - 1) // 2]
        return self._t[(key, s)]

    def norm(self, key: tuple, s: int) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            return self.steps(key, s) / self.steps(key, 0)

    @staticmethod
    def share(cond: np.ndarray, what: str, shares: list[tuple[str, float]]) -> str:
        """Record the share of replicates where `cond` holds (under the name `what`) and format it."""
        x = float(np.mean(cond))
        shares.append((what, x))
        return f"bootstrap {100 * x:.0f}%"


SOLID = 0.8     # a comparison that holds in fewer bootstrap replicates than this is "within seed noise"


def _qualified(verdict: str, shares: list[tuple[str, float]]) -> str:
    weak = [w for w, x in shares if x < SOLID]
    if verdict != "holds" or not weak:
        return verdict
    return f"holds, but within seed noise for {', '.join(weak)} (bootstrap < {100 * SOLID:.0f}%)"


def claims(cells: list[Cell], spec: Any) -> list[dict[str, str]]:
    """Dai et al.'s four claims (and the remedies), each with a verdict at the largest s, the evidence, and the
    share of seed-bootstrap replicates (`Bootstrap`) in which the comparison at the largest s holds."""
    rows = _rows(cells)
    plain = next(iter(spec.variants))
    labels = list(spec.models)
    deep, s_pos = labels[-1], [s for s in spec.staleness if s > 0]
    s_max = max(spec.staleness)
    K = spec.workers
    key = lambda lab, opt, k=K, var=plain: (lab, opt, var, k)  # noqa: E731
    val = lambda lab, opt, s, k=K, var=plain: _value(rows.get(key(lab, opt, k, var), {}).get(s))  # noqa: E731
    boot = Bootstrap(cells, len(spec.seeds))
    has = lambda *keys: all(k in rows and s_max in rows[k] and 0 in rows[k] for k in keys)  # noqa: E731
    out = []
    # 1. monotone in s
    mono, ends, ev = [], [], []
    for (lab, opt, var, k), by_s in rows.items():
        ss = [s for s in spec.staleness if s in by_s]
        t = [by_s[s]["steps"] if by_s[s]["steps"] is not None else np.inf for s in ss]
        dips = [f"s={a} {x:g} -> s={b} {y:g}" for a, b, x, y in zip(ss, ss[1:], t, t[1:]) if y < x]
        mono.append(not dips)
        if 0 in by_s and s_max in by_s and s_max > 0:
            ends.append(t[-1] > t[0])
        if dips:
            ev.append(f"{lab} {opt}{'' if var == plain else ' ' + var} K={k}: " + ", ".join(dips))
    v1 = "holds" if mono and all(mono) and all(ends) else ("partly" if ends and all(ends) else _verdict(ends))
    out.append({"claim": "1. more staleness costs more steps", "verdict": v1,
                "evidence": f"T(s) non-decreasing in {sum(mono)} of {len(mono)} rows; T(s_max) > T(0) in "
                            f"{sum(ends)} of {len(ends)}" + (f"; dips: {'; '.join(ev)}" if ev else "")})
    # 2. depth
    if len(labels) >= 2:
        res, ev, shares = {}, [], []
        for s in s_pos:
            for opt in spec.optimizers:
                vals = [val(lab, opt, s) for lab in labels]
                order = [greater(b, a) for a, b in zip(vals, vals[1:])]
                res[(s, opt)] = False if False in order else (None if None in order else True)
                if s == s_max:
                    text = f"{opt}: " + " < ".join(f"{lab} {_fmt(v)}" for lab, v in zip(labels, vals))
                    if has(*(key(lab, opt) for lab in labels)):
                        n = [boot.norm(key(lab, opt), s) for lab in labels]
                        text += f" ({boot.share(np.all([a < b for a, b in zip(n, n[1:])], axis=0), opt, shares)})"
                    ev.append(text)
        at_max = [res[(s_max, o)] for o in spec.optimizers] if s_max > 0 else []
        held = sum(v is True for v in res.values())
        out.append({"claim": f"2. deeper models are more sensitive ({' < '.join(labels)})",
                    "verdict": _qualified(_verdict(at_max), shares),
                    "evidence": f"at s={s_max}: " + "; ".join(ev) + f" — ordered at {held} of {len(res)} "
                                "(s > 0, optimizer) pairs"})
    # 3. momentum / Adam vs SGD on the deep model
    others = [o for o in ("momentum", "adam") if o in spec.optimizers]
    if "sgd" in spec.optimizers and others:
        per_s = {s: [greater(val(deep, o, s), val(deep, "sgd", s)) for o in others] for s in s_pos}
        ev, shares = [f"sgd {_fmt(val(deep, 'sgd', s_max))}"], []
        for o in others:
            text = f"{o} {_fmt(val(deep, o, s_max))}"
            if has(key(deep, o), key(deep, "sgd")):
                cond = boot.norm(key(deep, o), s_max) > boot.norm(key(deep, "sgd"), s_max)
                text += f" ({boot.share(cond, o, shares)})"
            ev.append(text)
        held = sum(all(r is True for r in v) for v in per_s.values())
        out.append({"claim": f"3. {' and '.join(others)} more sensitive than SGD on the deep model ({deep})",
                    "verdict": _qualified(_verdict(per_s.get(s_max, [])), shares),
                    "evidence": f"at s={s_max}: " + ", ".join(ev) + f" — holds at {held} of {len(per_s)} s > 0"})
    # 4. workers
    ks = [k for k in spec.worker_counts if k != K]
    opts = [o for o in spec.worker_optimizers if o in spec.optimizers]
    if ks and opts:
        per_s = {s: [greater(val(deep, o, s, k), val(deep, o, s)) for o in opts for k in ks] for s in s_pos}
        ev, shares = [], []
        for o in opts:
            parts = [f"K={K} {_fmt(val(deep, o, s_max))}"]
            for k in ks:
                text = f"K={k} {_fmt(val(deep, o, s_max, k))}"
                if has(key(deep, o, k), key(deep, o)):
                    cond = boot.norm(key(deep, o, k), s_max) > boot.norm(key(deep, o), s_max)
                    text += f" ({boot.share(cond, f'{o} K={k}', shares)})"
                parts.append(text)
            ev.append(f"{o}: " + ", ".join(parts))
        held = sum(all(r is True for r in v) for v in per_s.values())
        out.append({"claim": f"4. more workers amplify the effect ({deep}, K = {', '.join(map(str, [K, *ks]))})",
                    "verdict": _qualified(_verdict(per_s.get(s_max, [])), shares),
                    "evidence": f"at s={s_max}: " + "; ".join(ev) + f" — holds at {held} of {len(per_s)} s > 0"})
    # remedies: fewer steps than the plain optimizer at the same s (paired by seed)
    for var in list(spec.variants)[1:]:
        for lab in labels:
            for opt in spec.optimizers:
                p, r = rows.get(key(lab, opt, K, plain), {}), rows.get(key(lab, opt, K, var), {})
                res, ev, shares = [], [], []
                for s in s_pos:
                    a, b = p.get(s), r.get(s)
                    if a is None or b is None:
                        continue
                    ta, tb = (np.inf if c["steps"] is None else c["steps"] for c in (a, b))
                    res.append(None if ta == tb == np.inf else bool(tb < ta))
                    wins = sum((y if y is not None else np.inf) < (x if x is not None else np.inf)
                               for x, y in zip(a["seed_steps"], b["seed_steps"]))
                    text = (f"s={s}: {_steps(a, spec)} -> {_steps(b, spec)} (fewer on {wins}/{len(a['seed_steps'])} "
                            "seeds")
                    if s == s_max:
                        text += ", " + boot.share(boot.steps(key(lab, opt, K, var), s)
                                                  < boot.steps(key(lab, opt, K, plain), s), f"s={s}", shares)
                    ev.append(text + ")")
                out.append({"claim": f"remedy {var} on {lab} {opt}: fewer steps than plain {opt}",
                            "verdict": _qualified(_verdict(res[-1:]), shares) if res else "not in this sweep",
                            "evidence": "; ".join(ev) + f" — fewer at {sum(x is True for x in res)} of {len(res)} "
                                                        "s > 0"})
    return out


def trend_note(cells: list[Cell], spec: Any) -> str:
    """The per-row numbers in one line each, then the claim verdicts (nothing hard-coded)."""
    many = len({c["variant"] for c in cells}) > 1
    show_k = len({c["workers"] for c in cells}) > 1 or spec.workers != 1
    lines = []
    for by_s in _rows(cells).values():
        first = next(iter(by_s.values()))
        pts = ", ".join(f"s={s}: " + (f"{c['steps']:.0f}" if c["steps"] is not None else f"> {spec.max_steps}")
                        + f" (lr {c['lr']:g}{', ' + str(c['censored']) + ' censored' if c['censored'] else ''})"
                        for s, c in sorted(by_s.items()))
        lines.append(f"- {_row_name(first, many, show_k)}: steps to {100 * spec.target_acc:g}% — {pts}")
    edges = [c for c in cells if c["lr_edge"]]
    widened = sum(1 for c in cells if c["widened"])
    lines += ["", f"lr grids: widened in {widened} of {len(cells)} cells; " + (
        "every chosen lr is inside its grid." if not edges else
        f"{len(edges)} chosen lr(s) still at an edge after widening: " + ", ".join(
            f"{_row_name(c, many, show_k)} s={c['staleness']} lr {c['lr']:g} ({c['lr_edge']})" for c in edges))]
    lines.append("")
    for c in claims(cells, spec):
        head, sep, rest = c["verdict"].partition(",")
        lines.append(f"{c['claim']}: {head.upper()}{sep}{rest} — {c['evidence']}")
    return "\n".join(lines)


def plot_curve(cells: list[Cell], spec: Any, out: Path) -> Path:
    """staleness_curve.png: median steps (top) and normalised cost (bottom) vs s, one panel per optimizer (lines:
    models, or variants) and one per worker-count optimizer (lines: K); censored cells as open triangles at their
    lower bound."""
    from matplotlib.ticker import FuncFormatter

    from pslab.experiments.results.plots import plt, save_figure
    rows = _rows(cells)
    plain, K = next(iter(spec.variants)), spec.workers
    many = len(spec.variants) > 1
    panels: list[tuple[str, list[tuple[str, tuple]]]] = []
    for opt in spec.optimizers:
        lines = [(f"{lab}" + (f" {var}" if many else ""), (lab, opt, var, K))
                 for lab in spec.models for var in spec.variants if (lab, opt, var, K) in rows]
        panels.append((f"{opt}" + (f", K = {K}" if K != 1 or spec.worker_counts else ""), lines))
    deep = list(spec.models)[-1]
    for opt in spec.worker_optimizers:
        lines = [(f"K = {k}", (deep, opt, plain, k)) for k in sorted({K, *spec.worker_counts})
                 if (deep, opt, plain, k) in rows]
        if len(lines) > 1:
            panels.append((f"{deep} {opt}: workers", lines))
    fig, axes = plt.subplots(2, len(panels), figsize=(4.6 * len(panels), 7.5), squeeze=False)
    for j, (title, lines) in enumerate(panels):
        for name, key in lines:
            by_s = rows[key]
            xs = sorted(by_s)
            for i, field in enumerate(("steps", "normalised")):
                ax = axes[i][j]
                ys = [by_s[s][field] if by_s[s][field] is not None else np.nan for s in xs]
                (ln,) = ax.plot(xs, ys, marker="o", ms=4, label=name)
                cens = [(s, spec.max_steps if i == 0 else by_s[s]["normalised_lower"]) for s in xs
                        if by_s[s]["steps"] is None]
                cens = [(s, y) for s, y in cens if y is not None]
                if cens:
                    ax.plot([s for s, _ in cens], [y for _, y in cens], "^", mfc="none", mew=1.5, ms=9,
                            color=ln.get_color())
        axes[0][j].set_title(title)
        axes[0][j].set_ylabel(f"median steps to {100 * spec.target_acc:g}% (seeds {len(spec.seeds)})")
        axes[1][j].set_ylabel("normalised: T(s) / T(0)")
        axes[1][j].axhline(1.0, color="gray", lw=0.8, ls=":")
        for i in range(2):
            ax = axes[i][j]
            ax.set_xscale("symlog", linthresh=1)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
            ax.set_xticks(list(spec.staleness), [str(s) for s in spec.staleness])
            ax.set_xlim(-0.4, max(spec.staleness) * 1.25 + 0.4)
            ax.set_xlabel(f"staleness s ({spec.delay} delays)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    return save_figure(fig, out / "staleness_curve.png",
                       f"Staleness emulation (Dai et al. 2019): lr bracketed per cell, median over {len(spec.seeds)} "
                       f"seeds\nopen triangle: more than half the seeds censored at {spec.max_steps} steps "
                       "(drawn at the lower bound)", 9)
