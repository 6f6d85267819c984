"""The tour's frame: a step is one claim of the article, a small real experiment, and the figures it measured next to
the theory that predicts them.

A step's `run(ctx)` returns an `Outcome`: its `Figure`s (measured, theory, how they must agree), one paragraph that
explains what the numbers show, and the picture it drew (in ctx.out). A figure agrees when

    relation "=":   |measured − theory| ≤ tolerance · |theory|   (tolerance 0: exactly equal, as counters are)
    relation "<=":  measured ≤ theory · (1 + tolerance)           (a bound: "within 1.5×", "less than")
    relation ">=":  measured ≥ theory · (1 − tolerance)

Where no small experiment can speak (a 70B model's memory, a year on an H100), a step adds `Modelled` rows: one
number from a model, printed as such and never counted as agreement. Every step has at least one measured figure.

`run_steps` runs the chosen steps in the article's order, prints each as it ends (claim, table, paragraph, picture),
and returns the results; `write_index` writes the index page (every claim, its command, its figures, its picture).

A figure marked `timed` is read off a clock (a step time, a bubble from spans, a detection delay, a staleness that
depends on who was scheduled first): one sample of a noisy quantity. Beside other work (a test suite, two busy loops
in CI) a wake-up late by a few milliseconds moves a bubble or a step-time ratio past its rule now and then, while
the next run of the same step lands inside it. So a step whose misses are all timed figures is measured again, up
to `retries` more times; the last measurement is the one shown, and each earlier miss is printed and kept as a note
("try 1 missed: ..."). A step that misses any other figure — a counter or a parity (= exactly), a ratio of bytes, a
slope of memory, a result of seeded training, whatever its tolerance — is not re-measured: the same run gives the
same number, so a miss is a bug, not noise; neither is a step that raised. A timed figure always has a tolerance or
a bound (a clock never agrees "exactly").
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

RELATIONS = ("=", "<=", ">=")


class TourError(ValueError):
    """A bad step name or option: one line, exit 1."""


@dataclass(frozen=True)
class Figure:
    """One number measured next to the number theory gives for it."""
    name: str
    measured: float
    theory: float
    unit: str = ""
    relation: str = "="
    tolerance: float = 0.0
    how: str = ""              # where each number comes from: "counters; 2(N−1)/N·S"
    timed: bool = False        # read off a clock: noise beside other work, so a miss is measured again (above)

    @property
    def exact(self) -> bool:
        """A counter or a parity ("= exactly")."""
        return self.relation == "=" and self.tolerance == 0

    def __post_init__(self) -> None:
        if self.relation not in RELATIONS:
            raise ValueError(f"figure {self.name!r}: relation must be one of {RELATIONS}, got {self.relation!r}")
        if not self.tolerance >= 0:
            raise ValueError(f"figure {self.name!r}: tolerance must be >= 0, got {self.tolerance}")
        if self.timed and self.exact:
            raise ValueError(f"figure {self.name!r}: a timed figure needs a tolerance or a bound (<=, >=); a clock "
                             "never agrees exactly")

    @property
    def agrees(self) -> bool:
        m, t, tol = self.measured, self.theory, self.tolerance
        if not (math.isfinite(m) and math.isfinite(t)):
            return False
        if self.relation == "<=":
            return m <= t * (1 + tol) if t >= 0 else m <= t * (1 - tol)
        if self.relation == ">=":
            return m >= t * (1 - tol) if t >= 0 else m >= t * (1 + tol)
        return abs(m - t) <= tol * abs(t) + (1e-12 if tol == 0 else 0.0) * max(1.0, abs(t))

    @property
    def rule(self) -> str:
        """The agreement rule in words: "= exactly", "= within 10 %", "<= (+5 %)"."""
        pct = f"{self.tolerance * 100:.2g} %"
        if self.relation == "=":
            return "= exactly" if self.tolerance == 0 else f"= within {pct}"
        slack = f" ({'+' if self.relation == '<=' else '−'}{pct} slack)" if self.tolerance else ""
        return f"{self.relation}{slack}"


@dataclass(frozen=True)
class Modelled:
    """A number only a model gives here (no GPU, no 70B model): shown as the model's, not as a measurement."""
    name: str
    value: float
    unit: str = ""
    how: str = ""


@dataclass
class Outcome:
    """What a step's run returns."""
    figures: list[Figure]
    explanation: str
    picture: str | None = None
    notes: list[str] = field(default_factory=list)   # what a reader should know (regime, what was scaled down)
    modelled: list[Modelled] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    """One claim of the article, in its order."""
    key: str                   # the name `pslab tour KEY` takes
    section: str               # the article's section heading
    claim: str                 # the article's sentence (shortened)
    command: str               # the pslab command that shows it in depth
    run: Callable[["Context"], Outcome]
    budget_s: float = 60.0     # the most this step may take in a full tour on 2 cores


@dataclass
class Context:
    """What a step gets: where to draw, how big to go (quick: the test's sizes), a seed, and a progress line."""
    out: Path
    quick: bool = False
    seed: int = 0
    say: Callable[[str], None] = lambda s: None

    def picture(self, key: str) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        return self.out / f"{key}.png"


@dataclass
class Result:
    key: str
    section: str
    claim: str
    command: str
    figures: list[Figure]
    explanation: str
    picture: str | None
    notes: list[str]
    seconds: float
    budget_s: float
    error: str = ""
    modelled: list[Modelled] = field(default_factory=list)
    tries: int = 1             # how many times the step was measured (module docstring: re-measuring)

    @property
    def agrees(self) -> bool:
        return not self.error and bool(self.figures) and all(f.agrees for f in self.figures)

    def as_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["agrees"] = self.agrees
        for f, fd in zip(self.figures, d["figures"]):
            fd["agrees"], fd["rule"] = f.agrees, f.rule
        return d


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    a = abs(x)
    if a != 0 and (a >= 1e6 or a < 1e-3):
        return f"{x:.3e}"
    return f"{x:.4g}"


def print_result(r: Result, out: TextIO, index: int | None = None) -> None:
    head = f"[{index}] " if index is not None else ""
    print(f"\n{head}{r.section} — {r.key}", file=out)
    print(f"  claim: {r.claim}", file=out)
    if r.error:
        print(f"  FAILED: {r.error}", file=out)
        return
    w = max([len(f.name) for f in r.figures] + [6])
    print(f"  {'figure':<{w}}  {'measured':>12}  {'theory':>12}  {'unit':<10} rule{'':<21} agrees", file=out)
    for f in r.figures:
        print(f"  {f.name:<{w}}  {_fmt(f.measured):>12}  {_fmt(f.theory):>12}  {f.unit:<10} {_shown_rule(f):<25} "
              f"{'yes' if f.agrees else 'NO'}", file=out)
        if f.how:
            print(f"  {'':<{w}}    {f.how}", file=out)
    for m in r.modelled:
        print(f"  {m.name:<{w}}  {'(model)':>12}  {_fmt(m.value):>12}  {m.unit:<10} not measured here", file=out)
        if m.how:
            print(f"  {'':<{w}}    {m.how}", file=out)
    for line in _wrap(r.explanation, 110):
        print(f"  {line}", file=out)
    for n in r.notes:
        print(f"  note: {n}", file=out)
    pic = f"  picture: {r.picture}" if r.picture else ""
    print(f"{pic}  ({r.seconds:.1f} s; in depth: {r.command})", file=out)


def _shown_rule(f: Figure) -> str:
    """The rule as the table and the index show it: "= within 10 %, timed" for a figure read off a clock."""
    return f"{f.rule}, timed" if f.timed else f.rule


def _wrap(text: str, width: int) -> list[str]:
    import textwrap
    return textwrap.wrap(" ".join(text.split()), width) if text else []


def _missed(figures: list[Figure]) -> str:
    """The figures that missed their rule, in one line: "name measured vs theory (rule); ..."."""
    return "; ".join(f"{f.name} {_fmt(f.measured)} vs {_fmt(f.theory)} ({f.rule})" for f in figures if not f.agrees)


def _run_one(step: Step, ctx: Context, keep_going: bool, retries: int) -> Result:
    """One step: measured, and measured again (at most `retries` more times) while it misses only noisy figures."""
    t0 = time.perf_counter()
    earlier: list[str] = []
    for attempt in range(1, retries + 2):
        try:
            o = step.run(ctx)
            if not o.figures:
                raise TourError(f"step {step.key} measured nothing (every step prints a measured figure)")
        except Exception as e:  # a step's failure is a finding to print, not a reason to lose the tour
            if not keep_going:
                raise
            return Result(step.key, step.section, step.claim, step.command, [], "", None, earlier,
                          time.perf_counter() - t0, step.budget_s, error=f"{type(e).__name__}: {e}"[:400],
                          tries=attempt)
        missed = [f for f in o.figures if not f.agrees]
        if not missed or attempt > retries or not all(f.timed for f in missed):
            notes = (earlier + [f"measured {attempt} times: the earlier tries missed a timed figure (above), "
                                "this one is shown"] if earlier else []) + o.notes
            return Result(step.key, step.section, step.claim, step.command, o.figures, o.explanation, o.picture,
                          notes, time.perf_counter() - t0, step.budget_s, modelled=o.modelled, tries=attempt)
        earlier.append(f"try {attempt} missed: {_missed(o.figures)}")
        ctx.say(f"  {step.key}: try {attempt} missed a timed figure ({_missed(o.figures)}); measuring again")
    raise AssertionError("unreachable")


def run_steps(steps: Iterable[Step], ctx: Context, out: TextIO, keep_going: bool = True, retries: int = 1
              ) -> list[Result]:
    """Run `steps` in order, printing each as it ends. A step that raises is reported (FAILED, its error in one
    line) and the tour goes on (keep_going) — the other claims still deserve their figures. A step that misses only
    timed figures is measured again, up to `retries` more times (module docstring)."""
    if not 0 <= retries <= 5:
        raise TourError(f"retries must be between 0 and 5, got {retries}")
    results = []
    for i, step in enumerate(steps, 1):
        ctx.say(f"[{i}] {step.key} ...")
        res = _run_one(step, ctx, keep_going, retries)
        print_result(res, out, i)
        out.flush()
        results.append(res)
    return results


def run_summary(config: Path | None, overrides: list[str], root: str, label: str) -> dict[str, Any]:
    """One real run (experiments.runner.execute: real processes on 127.0.0.1, each one thread) of a config file
    (None: the default one) with `overrides`, into `root`; its summary.json."""
    from pslab.experiments.config import load_config
    from pslab.experiments.runner import execute
    rd = execute(load_config(config, overrides), root, label=label, quiet=True)
    return json.loads((rd.path / "summary.json").read_text())


def kinds(summary: dict[str, Any]) -> dict[str, float]:
    """A run summary's measured bytes per step by kind (dp, tp, pp, zero, cp, ep, ps)."""
    return {k: float(v["measured_per_step"]) for k, v in summary.get("bytes_by_kind", {}).items()}


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (results/plots.py's): every step's picture is drawn with it."""
    from pslab.experiments.results.plots import plt
    return plt


def save(fig: Any, path: Path | str) -> str:
    """Lay out, write (110 dpi) and close a step's figure (results/plots.py's save_figure); its path."""
    from pslab.experiments.results.plots import save_figure
    return str(save_figure(fig, Path(path)))


def write_json(results: list[Result], path: str, quick: bool, seconds: float) -> None:
    data = {"quick": quick, "seconds": seconds, "steps": [r.as_json() for r in results],
            "agree": sum(r.agrees for r in results), "total": len(results)}
    text = json.dumps(data, indent=1)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")


INTRO = """Every claim of the article, in its order, shown by a small real experiment on this machine: real processes,
real sockets, counters and clocks. Each step prints what it **measured** next to what **theory** predicts, and the
rule by which they must agree: "= exactly" for counters and parity (bytes, parameters, saved tensors), "= within x %"
for times (with the regime said), "<=" / ">=" for bounds. Lines "(model, not measured here)" are numbers only a
model can give here (a 70B model, an H100): they are shown, never counted as agreement. Run one step with `pslab tour KEY`, all of them
with `pslab tour` (about 2.5 minutes on 2 cores; `--quick`: about one), and go further with each step's command.
A figure marked "timed" is read off a clock (a step time, a bubble, a detection delay): one sample of a noisy
quantity. A step that missed only timed figures is measured once more (`--retries`): the last try is shown, and
every earlier miss is printed as a note; any other miss is a wrong number, never re-measured."""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _anchor(i: int, key: str) -> str:
    """The GitHub anchor of the heading "## {i}. {key}"."""
    return f"{i}-{key}".lower()


def write_index(results: list[Result], path: Path, quick: bool, seconds: float, pictures_rel: Path | None = None
                ) -> Path:
    """The index page: every claim in the article's order, its command, its figures and its picture."""
    lines = ["# The article, claim by claim (`pslab tour`)", "", INTRO, "",
             f"This page: `pslab tour{' --quick' if quick else ''}` in {seconds:.0f} s; "
             f"{sum(r.agrees for r in results)} of {len(results)} steps agree with their theory.", "",
             "| # | section | claim | figure: measured vs theory | agrees | in depth |",
             "|---|---|---|---|---|---|"]
    for i, r in enumerate(results, 1):
        figs = "<br>".join(_cell(f"{f.name}: {_fmt(f.measured)} vs {_fmt(f.theory)} {f.unit} ({_shown_rule(f)})")
                           for f in r.figures) or _cell(r.error)
        lines.append(f"| {i} | {r.section} | [{r.key}](#{_anchor(i, r.key)}) {_cell(r.claim)} | {figs} | "
                     f"{'yes' if r.agrees else 'no'} | `{_cell(r.command)}` |")
    section = ""
    for i, r in enumerate(results, 1):
        if r.section != section:
            section = r.section
            lines += ["", f"# {section}"]
        lines += ["", f"## {i}. {r.key}", "", f"> {r.claim}", ""]
        if r.error:
            lines += [f"Failed: {r.error}"]
            continue
        lines += [" ".join(r.explanation.split()), ""]
        lines += [f"- {f.name}: measured **{_fmt(f.measured)}** {f.unit}, theory **{_fmt(f.theory)}** "
                  f"({_shown_rule(f)}; "
                  f"{'agrees' if f.agrees else 'does not agree'}){' — ' + f.how if f.how else ''}"
                  for f in r.figures]
        lines += [f"- {m.name} (model, not measured here): **{_fmt(m.value)}** {m.unit}"
                  f"{' — ' + m.how if m.how else ''}" for m in r.modelled]
        lines += [f"- note: {n}" for n in r.notes]
        if r.picture:
            pic = Path(r.picture)
            rel = (pictures_rel / pic.name) if pictures_rel is not None else pic
            lines += ["", f"![{r.key}]({rel.as_posix()})"]
        lines += ["", f"In depth: `{r.command}`. Alone: `pslab tour {r.key}`."]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path
