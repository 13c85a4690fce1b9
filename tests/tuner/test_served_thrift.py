"""The served stage's thrift (tuner/served.py Thrift, issue 41 item 4) on a sim study with a server stand-in whose
times and peaks are set: finalists screened by their llama-bench runs, a twin only where the server left 256 MiB,
contenders behind after a round not served again, the stage ending once one is left, and the same pick as the full
confirmation (every contender, 3 rounds). The real CPU llama-server runs it in
tests/runtime/test_time_to_answer_benchmark.py."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from planner.engine_contract import Measurement
from tuner.records import ServedRun, StudyRecord
from tuner.served import (
    FULL, THRIFT, TWIN_MIN_LEFT, Served, Thrift, confirm_served, dropped, partial_record, same_verdict, screen,
    served_budget,
)

from test_served import rag_tuners  # noqa: E402  (the sim rag study of the served tests)

MiB = 1 << 20


class StandIn:
    """llama-server on a GPU: a plan's request time falls with the expert bytes it holds on the GPU (10 s less a
    second a GiB), --fit's is 9 s plus ubatch/4096; a plan's server peaks `left` under the budget, a filled twin's
    at what the fill aimed for. Every run is logged (key-like tuples) with the repetitions it was asked for."""

    def __init__(self, tuner, left: int):
        self.t, self.left, self.runs, self.reps = tuner, left, [], []

    def measure_workload(self, inv, plan, workload, repetitions=None):
        budget = served_budget(self.t.hw)["CUDA0"]
        on_gpu = sum(t.nbytes for t in inv.allocated() if t.is_expert and plan.assignment[t.name] != "CPU")
        filled = "filled" in (plan.label or "")
        self.runs.append(("plan", plan.id, filled))
        self.reps.append(repetitions)
        peak = budget - (200 * MiB if filled else self.left)
        return Measurement(1000.0, 40.0, {"CUDA0": peak}, raw={"mean_request_s": 10.0 - on_gpu / (1 << 30),
                                                               "ttft_s": 1.0, "wall_s": 1.0})

    def fit_reference(self, inv, workload, budgets, ubatch, kv_type=None, threads=None, repetitions=None):
        self.runs.append(("fit", ubatch, kv_type))
        self.reps.append(repetitions)
        return Measurement(900.0, 41.0, {"CUDA0": budgets["CUDA0"] + 100 * MiB},
                           raw={"mean_request_s": 9.0 + ubatch / 4096, "ttft_s": 2.0, "wall_s": 1.0})


def _study(tmp_path, name="a"):
    (tmp_path / name).mkdir()
    tuner = rag_tuners(tmp_path / name, "f16")
    t = tuner()
    t.run(4)
    return tuner, t


def test_a_twin_only_where_the_server_left_256_mib(tmp_path):
    lines = []
    tuner, t = _study(tmp_path)
    server = StandIn(t, left=TWIN_MIN_LEFT - 56 * MiB)            # 200 MiB left: no twin
    rec = confirm_served(t.measurer, server, n_finalists=1, thrift=THRIFT, deadline=time.monotonic() + 3600,
                         say=lines.append)
    fills = StudyRecord.of(t.study).serving["fills"]
    assert list(fills.values()) == [None] and not any(k.startswith("fill:") for k in (r["key"] for r in
                                                                                      rec["results"]))
    assert any("no filled twin of trial" in x and "left 200.00 MiB of the budget unused (under 256.00 MiB)" in x
               for x in lines), lines
    # the same study, the same server leaving 700 MiB: the twin is made and served (the rule, not the fill, acted)
    tuner2, t2 = _study(tmp_path, "b")
    rec2 = confirm_served(t2.measurer, StandIn(t2, left=700 * MiB), n_finalists=1, thrift=THRIFT,
                          deadline=time.monotonic() + 3600)
    assert any(r["key"].startswith("fill:") and r["request_s"]["samples"] for r in rec2["results"])


def test_behind_after_a_round_is_not_served_again_and_the_full_check_agrees(tmp_path):
    """Round 1: the two filled twins are fastest, 1% apart (inside the noise): both are served again; every other
    contender's one sample is more than 5% behind the faster twin's, so none is. The full confirmation of the same
    study (FULL: 3 rounds, every contender) picks the same."""
    tuner, t = _study(tmp_path)
    server, lines = StandIn(t, left=700 * MiB), []
    rec = confirm_served(t.measurer, server, rounds=2, n_finalists=2, thrift=THRIFT, say=lines.append,
                         deadline=time.monotonic() + 3600)
    times = {r["key"]: r["request_s"]["samples"] for r in rec["results"]}
    pick = rec["pick"]
    twins = {k for k in times if k.startswith("fill:")}
    assert pick in twins and len(twins) == 2 and rec["rounds_served"] == 2
    assert {k for k, v in times.items() if len(v) == 2} == twins    # the close race: both rounds
    assert {r["key"] for r in rec["results"] if r["dropped"]} == set(times) - twins
    for r in rec["results"]:
        if r["key"] not in twins:                                  # its only sample > 1.05 x the pick's
            assert len(r["request_s"]["samples"]) == 1 and min(r["request_s"]["samples"]) > 1.05 * times[pick][0]
            assert r["dropped_why"].startswith("every sample behind trial ")
    assert sum(" is not served again: every sample behind " in x for x in lines) == len(times) - 2
    assert set(server.reps) == {1}                                 # each class timed once a run
    quick_runs = len(server.runs)
    assert quick_runs == len(times) + 2
    # resumed: the record is the same and nothing runs again
    again = confirm_served(tuner().measurer, server, rounds=2, n_finalists=2, thrift=THRIFT)
    assert len(server.runs) == quick_runs and again["pick"] == pick
    # the full check on the same study: every contender 3 rounds, the quick rows among them
    full = confirm_served(tuner().measurer, server, rounds=3, n_finalists=2, drop_behind=None, thrift=FULL)
    assert all(len(r["request_s"]["samples"]) == 3 for r in full["results"])
    assert len(server.runs) == 3 * len(full["results"])
    assert full["pick"] == pick and same_verdict(pick, full)
    assert not any(r["dropped"] for r in full["results"])


def test_the_stage_ends_once_one_contender_is_left(tmp_path):
    """One finalist: after round 1 its twin is ahead of everything by more than the noise, so it is the only one
    left and round 2 is not served at all; the full check agrees."""
    tuner, t = _study(tmp_path)
    server, lines = StandIn(t, left=700 * MiB), []
    rec = confirm_served(t.measurer, server, rounds=2, n_finalists=1, thrift=THRIFT, say=lines.append,
                         deadline=time.monotonic() + 3600)
    assert rec["pick"].startswith("fill:") and rec["rounds_served"] == 1
    assert len(server.runs) == len(rec["results"]) == 5           # 3 references, the finalist, its twin
    assert lines[-1].startswith(f"# served: trial {rec['pick'][5:]} filled is the only one left: no further run "
                                "can change the pick (5 of the 2 rounds' 10 runs served)"), lines
    full = confirm_served(tuner().measurer, server, rounds=3, n_finalists=1, drop_behind=None, thrift=FULL)
    assert full["pick"] == rec["pick"] and len(server.runs) == 15


def test_close_contenders_stay_in_the_race_and_failures_are_retried():
    """Within the noise (5%, or the wider spread) nobody is dropped after a round; a finalist over the budget is
    (it cannot be the pick); a contender that only failed is never 'behind'; a round not complete drops nobody."""
    cs = [Served("fit:512", "--fit", ("reference",), ubatch=512), Served("trial:1", "trial 1", ("finalist",), trial=1),
          Served("trial:2", "trial 2", ("finalist",), trial=2), Served("trial:3", "trial 3", ("finalist",), trial=3)]

    def row(key, rnd, s, peak=6000, ok=True):
        return ServedRun.from_dict({"round": rnd, "key": key, "ok": ok, "request_s": s, "ttft_s": 1.0, "pp_tps": 1.0,
                                    "tg_tps": 1.0, "peak_bytes": {"CUDA0": peak * MiB}})
    budget = {"CUDA0": 6144 * MiB}
    rows = [row("fit:512", 0, 10.0), row("trial:1", 0, 10.4), row("trial:2", 0, 8.0, peak=6200),
            row("trial:3", 0, 1.0, ok=False)]
    assert dropped(cs, rows[:3], None, THRIFT, budget) == {}        # trial 3 has not run: round 1 not done
    d = dropped(cs, rows, None, THRIFT, budget)
    # trial 1: 4% behind --fit, inside the noise; trial 2 faster but over the budget; trial 3 failed: kept
    assert set(d) == {"trial:2"} and d["trial:2"][1] == "over the budget after round 1"
    assert dropped(cs, rows, None, None, budget) == {}              # no thrift: far_behind alone
    # a second round: trial 1's 10.4 s is under --fit's slower 10.5 s: the samples overlap, still in the race
    rows += [row("fit:512", 1, 10.5), row("trial:1", 1, 11.5), row("trial:3", 1, 1.0, ok=False)]
    assert set(dropped(cs, rows, None, THRIFT, budget)) == {"trial:2"}
    # with no noise allowed, round 1 alone (10.4 > 10.0) drops it, and it stays dropped after round 2
    assert set(dropped(cs, rows, None, replace(THRIFT, behind_noise=0.0), budget)) == {"trial:2", "trial:1"}


def test_finalists_behind_by_llama_bench_at_the_workloads_sizes_are_not_served(tmp_path):
    """The study measured at the workload's sizes (bench_for): its own runs screen, nothing runs; a screened
    finalist is never served, said in a line, and a partial record does not wait for it."""
    tuner, t = _study(tmp_path)
    from tuner.records import TrialRecord
    from tuner.served import contenders
    finalists = [c for c in contenders(t.measurer, 4) if c.trial is not None]
    rt = t.measurer.request_time()
    secs = {}
    for c in finalists:
        r = TrialRecord.from_trial(t.measurer.trial(c.trial)).measured
        secs[c.key] = rt.mean_s(r.tg_tps, r.pp_tps)
    best = min(secs.values())
    factor = 1.0001
    expect = {k for k, v in secs.items() if v > factor * best}
    assert expect, secs                                             # the four plans differ
    runs = len(t.measurer.study.get_trials())
    assert set(screen(t.measurer, finalists, factor)) == expect
    assert len(t.measurer.study.get_trials()) == runs               # nothing ran
    assert screen(t.measurer, finalists, None) == {} and screen(t.measurer, finalists[:1], factor) == {}
    server, lines = StandIn(t, left=700 * MiB), []
    thrift = Thrift(screen_behind=factor)
    rec = confirm_served(t.measurer, server, rounds=1, n_finalists=4, thrift=thrift, say=lines.append,
                         deadline=time.monotonic() + 3600)
    served = {r["key"] for r in rec["results"]}
    assert set(rec["screened"]) == expect and not served & expect
    assert sum("is not served: llama-bench at the workload's sizes puts its mean request" in x for x in lines) == \
        len(expect)
    part = partial_record(StudyRecord.of(t.study), served_budget(t.hw))
    assert part is not None and not {r["key"] for r in part["results"]} & expect


@pytest.mark.parametrize("full_pick,median,hi,expect", [("fit:512", 9.0, 9.2, True), ("trial:1", 9.1, 9.2, True),
                                                        ("trial:1", 9.3, 9.2, False)])
def test_same_verdict_is_the_pick_or_within_the_full_picks_spread(full_pick, median, hi, expect):
    res = [{"key": "fit:512", "roles": ["reference"], "vram_device_bytes": {},
            "request_s": {"samples": [median], "median": median, "hi": median}},
           {"key": "trial:1", "roles": ["finalist"], "vram_device_bytes": {"CUDA0": 1},
            "request_s": {"samples": [9.0, hi], "median": 9.0, "hi": hi}}]
    full = {"pick": full_pick, "results": res, "budget_bytes": {"CUDA0": 2}}
    assert same_verdict("fit:512", full) is expect
    assert same_verdict(None, full) is False
