"""Time as time (issue 40, item 6): a time study stores the workload's tokens per second (larger is better, like
every objective), but shows its best value, its history plot and the web view in seconds per mean request, lower
is better, tokens per second beside it. What is stored is unchanged: the seconds are computed where shown."""
from __future__ import annotations

import math
import re

import pytest

from planner.hardware import resolve
from planner.loader import load_model
from planner.workload import preset
from runtime.sim import SimEngine
from tuner.objectives import RequestTime, bench_for
from tuner.report import study_summary, summary_markdown, trials_frame
from tuner.report_plots import figure
from tuner.search import Tuner, StudyConfig


@pytest.fixture(scope="module")
def time_study():
    inv, hw = load_model("preset:Qwen3-30B-A3B:Q4_K_M"), resolve("rtx4090-ddr5", "12GiB")
    w = preset("chat")
    t = Tuner(inv, hw, SimEngine(hw), StudyConfig(objective="time", bench=bench_for(w), requests=w,
                                                   n_ctx=9216, pool_size=20, seed=3))
    t.run(5)
    df = trials_frame(t.study)
    return t, df, study_summary(t.study, df)


def test_the_best_value_is_seconds_per_mean_request_with_tokens_per_second_beside(time_study):
    t, _, s = time_study
    best = s.to_dict()["best"]["objective"]
    req = RequestTime.from_dict(s.request_time)
    assert best["mean_request_s"] == pytest.approx(req.mean_s(best["tg_tps"], best["pp_tps"]))
    # the value as stored: the workload's tokens per second, which is its tokens over those seconds
    assert best["value"] == max(tr.values[0] for tr in t.study.trials if tr.values)
    assert best["value"] == pytest.approx(req.tokens_per_request() / best["mean_request_s"])
    assert 1 < best["mean_request_s"] < 60
    line = next(x for x in summary_markdown(s).splitlines() if x.startswith("### Best `time`"))
    assert line.startswith(f"### Best `time` = {best['mean_request_s']:.2f} s per mean request "
                           f"({best['value']:.4g} t/s of the workload): TG ")
    # the first line says the same seconds
    assert f"answers in {best['mean_request_s']:.2f} s mean" in s.headline


def test_the_history_plot_of_a_time_study_is_in_seconds_and_falls_as_it_gets_better(time_study):
    import matplotlib.pyplot as plt
    _, df, s = time_study
    fig = figure(df, s, "history")
    try:
        ax = fig.axes[0]
        assert re.match(r"mean request time \(s, predicted; lower is better\)", ax.get_ylabel())
        best = next(line for line in ax.lines if line.get_label() == "best so far")
        ys = [y for y in best.get_ydata() if not math.isnan(y)]
        assert ys and all(b <= a for a, b in zip(ys, ys[1:]))            # lower is better: it never climbs
        assert ys[-1] == pytest.approx(s.best["objective"]["mean_request_s"])
    finally:
        plt.close(fig)


def test_other_objectives_show_what_they_store():
    inv, hw = load_model("preset:Qwen3-30B-A3B:Q4_K_M"), resolve("rtx4090-ddr5", "12GiB")
    t = Tuner(inv, hw, SimEngine(hw), StudyConfig(objective="tg + 0.1*pp", pool_size=20))
    t.run(2)
    s = study_summary(t.study)
    assert "mean_request_s" not in s.best["objective"] and s.request_time is None
    assert f"### Best `tg + 0.1*pp` = {s.best['objective']['value']:.4g}: TG " in summary_markdown(s)
