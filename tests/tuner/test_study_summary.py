"""A study's report as a StudySummary (tuner.report): typed fields for the code that reads it, and to_dict
giving the JSON `report --json`, report.json, `tune --json` and the service have always had, key for key."""
from __future__ import annotations

import json

import pytest

from planner.hardware import GiB, MiB, load_hardware
from planner.presets import load_preset
from tuner.report import BudgetBest, EngineRuns, StudySummary, study_summary, write_study_report
from tuner.search import Tuner, StudyConfig, BenchRun
from runtime.sim import SimEngine

# the report's JSON keys in their order (the service's page and benchmarks/tune_vs_fit.py read them)
KEYS = ["study", "settings", "engine_runs", "budget_bytes", "reference", "confirmed", "front_share", "counts",
        "n_trials", "margin_bytes", "margin_events", "cost_fit", "best", "pareto", "per_budget", "baselines", "failed",
        "margin_by_ubatch", "keep_free_bytes"]


@pytest.fixture(scope="module")
def tuner():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    t = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        objective="tg + 0.1*pp", bench=BenchRun(n_prompt=512, n_gen=32), n_ctx=8192, margin=512 * MiB,
        storage=None, pool_size=20, seed=4))
    t.run(5)
    return t


def test_the_summary_is_typed_and_its_dict_is_the_reports_json(tuner):
    s = study_summary(tuner.study)
    assert isinstance(s, StudySummary) and s.files is None
    d = s.to_dict()
    assert list(d) == KEYS                                        # no "files" before a report is written
    assert isinstance(s.engine_runs, EngineRuns) and s.engine_runs.trials >= 5
    assert d["engine_runs"] == {"baselines": s.engine_runs.baselines, "trials": s.engine_runs.trials,
                                "confirmation": 0, "total": s.engine_runs.total}
    assert s.engine_runs.total == s.engine_runs.baselines + s.engine_runs.trials
    assert all(isinstance(b, BudgetBest) for b in s.per_budget) and s.per_budget
    assert d["per_budget"][0] == {"budget_bytes": s.per_budget[0].budget_bytes, "tg": s.per_budget[0].tg,
                                  "pp": s.per_budget[0].pp}
    assert set(s.best) == {"tg", "pp", "objective"} and s.best["objective"]["value"] > 0
    assert s.best["tg"]["measurement"]["ok"] and "CUDA0" in s.best["tg"]["devices"]
    assert s.n_trials == sum(s.counts.values()) and s.counts["complete"] >= 5
    assert json.loads(json.dumps(d)) == d                         # plain JSON, nothing to coerce


def test_the_written_report_is_the_summary_with_its_files(tuner, tmp_path):
    s = write_study_report(tuner.study, tmp_path / "rep")
    assert s.files and all(f.startswith(str(tmp_path / "rep")) for f in s.files)
    on_disk = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert list(on_disk) == KEYS + ["files"]
    # the folder's own report.json names its files relative to itself (issue 40 item 10)
    assert on_disk == json.loads(json.dumps(dict(s.to_dict(), files=[f.rsplit("/", 1)[1] for f in s.files])))
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert f"engine runs: {s.engine_runs.total} (baselines {s.engine_runs.baselines}" in md
    assert "## Best per VRAM budget" in md


def test_best_tg_is_not_a_dominated_run_within_a_hair_of_it():
    """Issue 'first hour' 3: trial 0 had TG 35.1462 and PP 33.1; trial 28 TG 35.1460 with 9.5x the PP and less VRAM.
    Runs within BEST_TIE of the best TG tie on it: the most PP, then the least VRAM, decides."""
    import pandas as pd

    from tuner.report import BEST_TIE, TOOLS_ORDER, _best

    def run(trial, tg, pp, vram):
        return {"trial": trial, "plan_id": f"p{trial}", "label": "", "source": "", "ok": True, "duplicate_of": None,
                "tg_tps": tg, "pp_tps": pp, "vram_bytes": vram, "cv": None, **{t: "" for t in TOOLS_ORDER}}
    df = pd.DataFrame([run(0, 35.1462, 33.1, 20e9), run(28, 35.1460, 314.0, 18e9), run(5, 30.0, 900.0, 10e9)])
    assert _best(df, "tg_tps")["trial"] == 28
    assert _best(df, "pp_tps")["trial"] == 5
    # a TG more than BEST_TIE better is the best, whatever it gives up
    df2 = pd.DataFrame([run(0, 35.1462 * (1 + 2 * BEST_TIE), 33.1, 20e9), run(28, 35.1460, 314.0, 18e9)])
    assert _best(df2, "tg_tps")["trial"] == 0
    # equal speeds: the least VRAM
    df3 = pd.DataFrame([run(1, 40.0, 100.0, 9e9), run(2, 40.0, 100.0, 8e9)])
    assert _best(df3, "tg_tps")["trial"] == 2
