"""The report's plots read at a glance (issue 29, item 7), checked on the matplotlib Figure objects of a small sim
study: every marker in one legend outside the axes, the budget line apart from the GPU memory line, the reference
drawn apart and named, axes around the points, a title with model, engine, budget and workload, "predicted" for
the sim engine."""
from __future__ import annotations

from dataclasses import replace

import pytest

from planner.bench_run import BenchRun
from planner.hardware import GiB, KEEP_FREE, load_hardware
from planner.presets import load_preset
from tuner.report import study_summary, trials_frame
from tuner.report_plots import PLOTS, figure
from tuner.search import Tuner, StudyConfig
from runtime.sim import SimEngine


@pytest.fixture(scope="module")
def study():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = replace(load_hardware("rtx4090-ddr5").with_vram([16 * GiB]), keep_free_bytes=KEEP_FREE)
    t = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        objective="both", bench=BenchRun(n_prompt=512, n_gen=32), n_ctx=8192, storage=None, pool_size=20,
        seed=4))
    t.run(6)
    df = trials_frame(t.study)
    return df, study_summary(t.study, df)


@pytest.fixture
def figs(study):
    import matplotlib.pyplot as plt
    df, summary = study
    out = {name: figure(df, summary, name) for name in PLOTS}
    yield out
    for f in out.values():
        plt.close(f)


def _legend_texts(fig) -> list[str]:
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)   # one, the figure's
    return [t.get_text() for t in fig.legends[0].get_texts()]


def _labelled(ax) -> set[str]:
    return {a.get_label() for a in [*ax.collections, *ax.lines] if not a.get_label().startswith("_")}


def test_every_marker_is_in_the_one_legend_outside_the_data(figs):
    for name, fig in figs.items():
        texts = _legend_texts(fig)
        for ax in fig.axes:
            assert _labelled(ax) <= set(texts), name
        fig.canvas.draw()
        box = fig.legends[0].get_window_extent()
        for ax in fig.axes:                  # the legend covers no axes, hence no point
            assert not box.overlaps(ax.get_window_extent()), name


def test_budget_reference_and_memory_are_distinct(study, figs):
    _, summary = study
    texts = _legend_texts(figs["throughput_vs_vram"])
    assert "budget 15.00 GiB" in texts and "GPU memory 16.00 GiB" in texts
    ref = summary.reference
    assert ref and f"reference: {ref}" in texts
    assert sum(t.startswith("reference:") for t in texts) == 1
    for ax in figs["throughput_vs_vram"].axes:
        lines = {ln.get_label(): ln for ln in ax.lines}
        budget, memory = lines["budget 15.00 GiB"], lines["GPU memory 16.00 GiB"]
        assert budget.get_xdata()[0] == 15.0 and memory.get_xdata()[0] == 16.0
        assert (budget.get_color(), budget.get_linestyle()) != (memory.get_color(), memory.get_linestyle())
        lo, hi = ax.get_xlim()
        assert lo < 15.0 and hi > 16.0                                     # both lines inside the axes
        assert any(t.get_text() == ref for t in ax.texts)                 # the reference named beside its point
    assert f"reference: {ref}" in _legend_texts(figs["pareto"])


def test_axes_hold_the_points_without_empty_space(study, figs):
    from tuner.confirm import vram_of
    df, summary = study
    ok = df[df["ok"] & df["vram_bytes"].notna()]
    base = [b["measured"] for b in summary.baselines if b.get("ok")]
    x = [*(ok["vram_bytes"] / GiB), *(vram_of(m) / GiB for m in base)]
    y = [*ok["tg_tps"], *(m["tg_tps"] for m in base)]
    ax = figs["throughput_vs_vram"].axes[0]
    lo, hi = ax.get_xlim()
    span = 16.0 - min(x)
    assert lo <= min(x) and hi >= 16.0
    assert min(x) - lo <= 0.1 * span and hi - 16.0 <= 0.1 * span          # no empty band beside the points
    ylo, yhi = ax.get_ylim()
    assert ylo == 0 and max(y) <= yhi <= 1.2 * max(y)


def test_titles_name_model_engine_budget_workload_and_predicted(figs):
    for name, fig in figs.items():
        text = fig.get_suptitle()
        for part in ("Qwen3-30B-A3B", "rtx4090-ddr5", "sim engine", "predicted", "budget 15.00 GiB",
                     "kept free: 1024 MiB", "workload: prompt 512, generate 32, depth 0"):
            assert part in text, (name, part)
    assert "predicted" in figs["throughput_vs_vram"].axes[0].get_ylabel()
    assert "predicted" in figs["pareto"].axes[0].get_xlabel()


def test_a_measured_engine_says_no_predicted_and_one_line_when_nothing_is_kept_free(study):
    import matplotlib.pyplot as plt
    df, summary = study
    hw = dict(summary.settings.hardware, keep_free=0)
    s = replace(summary, settings=replace(summary.settings, engine="llamacpp", hardware=hw),
                budget_bytes=16 * GiB, keep_free_bytes=0)
    fig = figure(df, s, "throughput_vs_vram")
    try:
        assert "predicted" not in fig.get_suptitle() and "llamacpp engine" in fig.get_suptitle()
        texts = _legend_texts(fig)
        assert "budget = GPU memory 16.00 GiB" in texts and not any(t.startswith("budget 1") for t in texts)
    finally:
        plt.close(fig)
