"""A study's plots (report.PLOTS): TG and PP against peak VRAM, TG against PP, the objective per trial. Drawn with
matplotlib (Agg) from the report's StudySummary and trials frame: `figures` gives the Figure objects (the tests
read their legends, titles and lines), `write_plots` saves each as PNG and SVG.

What a reader needs at a glance (issue 29, item 7): every marker in one legend, outside the data; the budget line
apart from the GPU memory line; the reference (the baseline the ratios are to) drawn apart from the other
baselines and named beside its point; axes limited to the points and those lines; a title with the model, the
engine, the budget and the workload, and "predicted" where the engine is the sim (the cost model: speeds
predicted, not measured)."""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.hardware import GiB, fmt_bytes, kept_free_text
from .confirm import vram_of
from .options import Settings

MARKERS = ["X", "D", "P", "s", "^", "v"]     # one per baseline other than the reference (a star)
# the reference: a large star under the front's small points (a front point on it stays visible), over the trials
REFERENCE = {"marker": "*", "s": 300, "c": "gold", "edgecolor": "k", "linewidths": 1.0, "zorder": 2.5}
PAD = 0.04                                   # of each axis' span, around the points and the lines


def predicted(settings: Settings) -> bool:
    """Whether the study's speeds are the cost model's (the sim engine), not measurements."""
    from planner.engine_registry import ENGINES
    spec = ENGINES.get(settings.engine)
    return spec is not None and not spec.traits.measured


def workload_text(settings: Settings) -> str:
    """The workload in a few words: the user's requests under the time objective, else the benchmark run's."""
    w = settings.bench
    bench = f"prompt {w.n_prompt}, generate {w.n_gen}, depth {w.depth}"
    requests = settings.requests
    return f"{requests['name']} requests (benchmark run: {bench})" if requests else bench


def title(summary: Any) -> str:
    """Three lines: the model, the machine and the engine; the budget; the workload and the objective."""
    s = summary.settings
    hw = s.hardware
    gpus = " + ".join(fmt_bytes(b) for _, b in hw.get("gpus", []))
    engine = f"{s.engine} engine" + (": predicted speeds, not measured" if predicted(s) else "")
    budget = (f"budget {fmt_bytes(summary.budget_bytes)} of {gpus} ({kept_free_text(summary.keep_free_bytes)} "
              "per GPU)" if summary.budget_bytes else "no GPU")
    return (f"{s.model_id} on {hw.get('name', '')}, {engine}\n"
            f"{budget}\nworkload: {workload_text(s)}; objective {s.objective}")


PLOTS = ("throughput_vs_vram", "pareto", "history")


def figure(df: Any, summary: Any, name: str) -> Any:
    """One plot (a name of PLOTS) as a matplotlib Figure; the caller closes it."""
    import matplotlib
    matplotlib.use("Agg")
    ok = df[df["ok"] & df["vram_bytes"].notna() & df["duplicate_of"].isna()] if not df.empty else df
    if name == "throughput_vs_vram":
        return plot_vs_vram(ok, summary)
    if name == "pareto":
        return plot_pareto(ok, summary)
    return plot_history(df, summary)


def write_plots(df: Any, summary: Any, out: Path) -> list[str]:
    """Each plot saved as PNG and SVG in OUT, one figure open at a time; the file names written."""
    import matplotlib.pyplot as plt
    files: list[str] = []
    for name in PLOTS:
        fig = figure(df, summary, name)
        try:
            for ext in ("png", "svg"):
                fig.savefig(out / f"{name}.{ext}", dpi=110 if ext == "png" else None)
                files.append(f"{name}.{ext}")
        finally:
            plt.close(fig)
    return files


def _baselines(summary: Any) -> list[tuple[dict[str, Any], bool]]:
    """The baselines that ran, each with whether it is the reference."""
    return [(b, b["name"] == summary.reference) for b in summary.baselines if b.get("ok")]


def _draw_baselines(ax: Any, summary: Any, x: Callable[[dict], float], y: Callable[[dict], float]) -> None:
    """Each baseline's point; the reference a large star over everything else (named by _name_reference)."""
    others = 0
    for b, is_ref in _baselines(summary):
        px, py = x(b), y(b)
        if is_ref:
            ax.scatter([px], [py], label=f"reference: {b['name']}", **REFERENCE)
        else:
            ax.scatter([px], [py], marker=MARKERS[others % len(MARKERS)], s=70, edgecolor="k", zorder=2.6,
                       label=b["name"])
            others += 1


def _name_reference(ax: Any, summary: Any, x: Callable[[dict], float], y: Callable[[dict], float]) -> None:
    """The reference's name beside its star, on the side of the axes with more room (after _limits)."""
    lo, hi = ax.get_xlim()
    for b, is_ref in _baselines(summary):
        if is_ref:
            left = x(b) > (lo + hi) / 2
            ax.annotate(b["name"], (x(b), y(b)), xytext=(-10 if left else 10, 8), textcoords="offset points",
                        ha="right" if left else "left", fontsize=8, zorder=7)


def _limits(ax: Any, xs: list[float], ys: list[float], y_floor_zero: bool = True) -> None:
    """Axes that hold every point and line, with PAD around them: no empty half, no point on a border."""
    xs, ys = [v for v in xs if v == v], [v for v in ys if v == v]     # NaN dropped
    if xs:
        lo, hi = min(xs), max(xs)
        pad = PAD * (hi - lo) or 0.5
        ax.set_xlim(lo - pad, hi + pad)
    if ys:
        lo, hi = (0.0 if y_floor_zero else min(ys)), max(ys)
        pad = PAD * (hi - lo) or 1.0
        ax.set_ylim(max(0.0, lo - pad) if y_floor_zero else lo - pad, hi + 2 * pad)   # room for the reference's name


def _legend_outside(fig: Any, axes: list[Any], loc: str = "outside lower center") -> Any:
    """One legend for the figure, outside every axes, with each labelled artist once (the panels share them); none
    when nothing is labelled (a study without a finished trial, baseline or GPU: matplotlib refuses ncol=0)."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    if not seen:
        return None
    return fig.legend(list(seen.values()), list(seen), loc=loc, ncol=min(len(seen), 4), fontsize=8, frameon=False)


def vram_front(df: Any, col: str) -> Any:
    """Trials that are the fastest (col) for their VRAM or less: the throughput-vs-VRAM Pareto front."""
    ok = df[df["ok"] & df[col].notna() & df["vram_bytes"].notna()]
    ok = ok.sort_values(["vram_bytes", col], ascending=[True, False])
    keep, best = [], -1.0
    for i, r in ok.iterrows():
        if r[col] > best:
            keep.append(i)
            best = r[col]
    return ok.loc[keep]


def plot_vs_vram(ok: Any, summary: Any) -> Any:
    """TG and PP against peak VRAM: the trials, their VRAM-Pareto front, the baselines (the reference apart), the
    confirmed medians, the budget and the GPU memory."""
    import matplotlib.pyplot as plt
    s = summary.settings
    total = sum(v for _, v in s.hardware.get("gpus", []))
    unit = " (predicted)" if predicted(s) else ""
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.6), layout="constrained")
    for ax, col, name in ((axes[0], "tg_tps", "TG"), (axes[1], "pp_tps", "PP")):
        xs: list[float] = []
        ys: list[float] = []
        if not ok.empty:
            ax.scatter(ok["vram_bytes"] / GiB, ok[col], s=14, c="0.7", label="trials", zorder=1)
            fr = vram_front(ok, col)
            ax.step(fr["vram_bytes"] / GiB, fr[col], where="post", c="C3", lw=1.5, zorder=2)
            ax.scatter(fr["vram_bytes"] / GiB, fr[col], s=30, c="C3", label="Pareto front (speed vs VRAM)", zorder=3)
            xs += list(ok["vram_bytes"] / GiB)
            ys += list(ok[col])
        x_of, y_of = (lambda b: vram_of(b["measured"]) / GiB), (lambda b, c=col: b["measured"][c])
        _draw_baselines(ax, summary, x_of, y_of)
        xs += [vram_of(b["measured"]) / GiB for b, _ in _baselines(summary)]
        ys += [b["measured"][col] for b, _ in _baselines(summary)]
        conf = [c for c in (summary.confirmed or {}).get("results", []) if c["vram_bytes"]]
        if conf:
            key = col.split("_")[0]
            ax.errorbar([c["vram_bytes"] / GiB for c in conf], [c[key]["median"] for c in conf],
                        yerr=[[c[key]["median"] - c[key]["lo"] for c in conf],
                              [c[key]["hi"] - c[key]["median"] for c in conf]],
                        fmt="o", mfc="none", c="C2", capsize=3, zorder=5, label="confirmed (median, range)")
            ys += [c[key]["hi"] for c in conf]
        xs += _memory_lines(ax, summary.budget_bytes, total)
        _limits(ax, xs, ys)
        _name_reference(ax, summary, x_of, y_of)
        ax.set_xlabel("peak VRAM (GiB, all GPUs)")
        ax.set_ylabel(f"{name} (tokens/s){unit}")
        ax.grid(alpha=0.3)
    _legend_outside(fig, list(axes))
    fig.suptitle(title(summary), fontsize=10)
    return fig


def _memory_lines(ax: Any, budget: int | None, total: int) -> list[float]:
    """The budget (solid, orange) and the GPU memory (dashed, grey), or one line where they are the same (nothing
    kept free, no margin); their x values, for the limits."""
    xs = []
    if budget and budget != total:
        ax.axvline(budget / GiB, ls="-", c="C1", lw=1.6, zorder=0, label=f"budget {fmt_bytes(budget)}")
        xs.append(budget / GiB)
    if total:
        same = budget == total
        ax.axvline(total / GiB, ls="-" if same else "--", c="C1" if same else "0.35", lw=1.6 if same else 1.0,
                   zorder=0, label=f"{'budget = ' if same else ''}GPU memory {fmt_bytes(total)}")
        xs.append(total / GiB)
    return xs


def plot_pareto(ok: Any, summary: Any) -> Any:
    """TG against PP: the trials, their front, the baselines (the reference apart)."""
    import matplotlib.pyplot as plt
    unit = " (predicted)" if predicted(summary.settings) else ""
    fig, ax = plt.subplots(figsize=(7.6, 5.6), layout="constrained")
    xs: list[float] = []
    ys: list[float] = []
    if not ok.empty:
        both = ok[ok["tg_tps"].notna() & ok["pp_tps"].notna()]
        ax.scatter(both["tg_tps"], both["pp_tps"], s=14, c="0.7", label="trials")
        front = summary.pareto
        ax.plot([r["tg_tps"] for r in front], [r["pp_tps"] for r in front], "o-", c="C3", ms=5, zorder=3,
                label="Pareto front")
        xs += list(both["tg_tps"])
        ys += list(both["pp_tps"])
    x_of, y_of = (lambda b: b["measured"]["tg_tps"]), (lambda b: b["measured"]["pp_tps"])
    _draw_baselines(ax, summary, x_of, y_of)
    xs += [x_of(b) for b, _ in _baselines(summary)]
    ys += [y_of(b) for b, _ in _baselines(summary)]
    _limits(ax, xs, ys)
    _name_reference(ax, summary, x_of, y_of)
    ax.set_xlabel(f"TG (tokens/s){unit}")
    ax.set_ylabel(f"PP (tokens/s){unit}")
    ax.grid(alpha=0.3)
    _legend_outside(fig, [ax])
    fig.suptitle(title(summary), fontsize=9)
    return fig


def _seconds(summary: Any) -> Callable[[Any], float] | None:
    """A time study's row (TG, PP) -> seconds per mean request (NaN where it cannot serve the workload); None for
    any other study, and for a time study stored without its request classes."""
    if summary.settings.objective != "time" or not getattr(summary, "request_time", None):
        return None
    from .objectives import RequestTime
    req = RequestTime.from_dict(summary.request_time)

    def one(r: Any) -> float:
        s = req.mean_s(float(r["tg_tps"]), float(r["pp_tps"])) if r["tg_tps"] == r["tg_tps"] else math.inf
        return s if math.isfinite(s) else math.nan
    return one


def _history(done: Any, col: str, seconds: Callable[[Any], float] | None) -> tuple[list[float], list[float]]:
    """Each complete trial's value and the best so far by the objective (the highest value stored); under time
    both in seconds per mean request, the best so far the seconds of the trial with the highest value so far (over
    a TTFT limit a quicker one may rank lower)."""
    if seconds is None:
        return list(done[col]), list(done[col].cummax())
    ys = [seconds(r) for _, r in done.iterrows()]
    best: list[float] = []
    top, at = -math.inf, math.nan
    for v, y in zip(done[col], ys):
        if v == v and v > top:
            top, at = v, y
        best.append(at)
    return ys, best


def plot_history(df: Any, summary: Any) -> Any:
    """The objective per trial (TG and PP for "both"; a time study's in seconds per mean request, lower is better),
    the best so far, failed and pruned trials at the worst end."""
    import matplotlib.pyplot as plt
    settings = summary.settings
    unit = ", predicted" if predicted(settings) else ""
    seconds = _seconds(summary)
    names = ([f"TG (t/s{unit})", f"PP (t/s{unit})"] if settings.objective == "both"
             else [f"mean request time (s{unit}; lower is better)"] if seconds is not None
             else [(settings.objective or "value") + (" (predicted)" if unit else "")])
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 3.2 * len(names) + 1.2), squeeze=False, layout="constrained")
    for i, name in enumerate(names):
        ax = axes[i][0]
        col = f"value{i}"
        if not df.empty and col in df:
            done = df[df["state"] == "complete"].sort_values("trial")
            ys, best = _history(done, col, seconds)
            ax.scatter(done["trial"], ys, s=12, c="C0", label="complete")
            ax.plot(done["trial"], best, c="C3", lw=1.5, label="best so far")
            fails = df[df["state"] == "fail"]
            pruned = df[df["state"] == "pruned"]
            finite = [y for y in ys if y == y]
            lo = (max(finite) if seconds is not None else min(finite)) if finite else 0.0     # the worst end
            ax.scatter(fails["trial"], [lo] * len(fails), marker="x", c="k", s=20, label="failed")
            ax.scatter(pruned["trial"], [lo] * len(pruned), marker="|", c="0.6", s=20, label="pruned / screened")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1][0].set_xlabel("trial")
    _legend_outside(fig, [a[0] for a in axes])
    fig.suptitle(title(summary), fontsize=9)
    return fig
