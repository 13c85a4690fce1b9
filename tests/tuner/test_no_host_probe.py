"""mainline's --no-host in the tuner (issue 10): a space dimension for real mainline engines, one probe run of the
best-TG plan with it per study (and the same probe with ik's -rtr), and studies stored before the option resume
as they were made."""
from __future__ import annotations

import pytest

from planner.flags import render
from planner.hardware import GiB, load_hardware
from tuner.records import TrialRecord
from tuner.search import Tuner, StudyConfig, BenchRun
from tuner.seeds import PROBE_NO_HOST, PROBE_RTR
from tuner.space import Space, SpaceConfig
from runtime.sim import SimEngine

WL = BenchRun(n_prompt=2048, n_gen=64, depth=0, repetitions=1)
ON = SpaceConfig(no_host=(False, True))


def test_no_host_dim_is_mainline_only_and_off_by_default(qwen_on_16gib):
    inv, hw = qwen_on_16gib
    assert "no_host" not in Space(inv, hw, dialect="mainline", n_ctx=4096).dims      # old studies' space
    assert "no_host" not in Space(inv, hw, dialect="ik", n_ctx=4096, config=ON).dims
    space = Space(inv, hw, dialect="mainline", n_ctx=4096, config=ON)
    assert space.dims["no_host"].values == (False, True) and space.default_params()["no_host"] is False
    p = {**space.default_params(), "fill.CUDA0": 0.0, "no_host": True}
    cand = space.decode(space.fixed(p))
    assert cand.plan.knobs.no_host and cand.plan.label.endswith("nohost")
    assert list(render(cand.plan, inv, "bench"))[-2:] == ["--no-host", "1"]
    # settled (what a real engine gets) keeps the default; `tune` adds (False, True) for mainline
    assert SpaceConfig().settled(16).no_host == (False,)


@pytest.mark.slow          # a whole sim study (~12 s on 2 cores): make test runs it, make test-fast does not
def test_probe_reruns_the_best_tg_plan_with_no_host_once(qwen_on_16gib):
    inv, hw = qwen_on_16gib
    tuner = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        objective="tg", bench=WL, n_ctx=4096, storage=None, pool_size=20, config=ON, seed=3,
        prescreen=True))   # seeds take half the runs, as for a real engine
    tuner.run(12)
    recs = [(t, TrialRecord.from_trial(t)) for t in tuner.study.get_trials(deepcopy=False)]
    probes = [(t, r) for t, r in recs if r.source == PROBE_NO_HOST]
    assert len(probes) == 1
    t, r = probes[0]
    outcome = tuner.study.user_attrs["probed_no_host"]
    assert outcome["queued"] and outcome["plan_id"] == r.plan_id
    assert t.params["no_host"] is True and r.measured is not None and r.measured.ok
    # it is an earlier best-TG trial's params with no_host flipped
    earlier = [u for u, s in recs if u.number < t.number and s.measured is not None and s.measured.ok
               and not u.params.get("no_host")]
    best = max(earlier, key=lambda u: TrialRecord.from_trial(u).measured.tg_tps)
    assert {k: v for k, v in t.params.items() if k != "no_host"} == \
        {k: v for k, v in best.params.items() if k != "no_host"}
    assert outcome["trial"] == best.number
    tuner.run(3)                                         # resumed in the same session: no second probe
    assert sum(TrialRecord.from_trial(u).source == PROBE_NO_HOST for u in tuner.study.get_trials()) == 1
    # asked again (the mark taken away): the best run's twin ran already, so the next-best run's twin is queued
    tuner.study.set_user_attr("probed_no_host", None)
    assert tuner.probe_repack()
    again = tuner.study.user_attrs["probed_no_host"]
    assert again["queued"] and again["trial"] != best.number and again["plan_id"] != r.plan_id
    # no probe where the space has no no_host dim, or nothing generates (PP only)
    plain = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        objective="tg", bench=WL, n_ctx=4096, storage=None, pool_size=20))
    plain.run(4)
    assert not plain.probe_repack()
    pp = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        objective="pp", bench=BenchRun(2048, 0, 0, 1), n_ctx=4096, storage=None, pool_size=20, config=ON))
    pp.run(3)
    assert not pp.probe_repack()


@pytest.mark.slow          # a whole sim study, as above
def test_an_ik_study_probes_its_best_tg_plan_with_rtr_once(qwen_on_16gib):
    """ik's -rtr repacks the weights kept in RAM as --no-host lets mainline do: the same one probe per study."""
    inv, hw = qwen_on_16gib
    tuner = Tuner(inv, hw, SimEngine(hw), StudyConfig(
        objective="tg", bench=WL, n_ctx=4096, storage=None, pool_size=20, dialect="ik",
        config=SpaceConfig(rtr=(False, True)), seed=3, prescreen=True))
    assert "no_host" not in tuner.space.dims and tuner.space.dims["rtr"].values == (False, True)
    tuner.run(12)
    recs = [(t, TrialRecord.from_trial(t)) for t in tuner.study.get_trials(deepcopy=False)]
    probes = [(t, r) for t, r in recs if r.source == PROBE_RTR]
    assert len(probes) == 1 and not any(r.source == PROBE_NO_HOST for _, r in recs)
    t, r = probes[0]
    outcome = tuner.study.user_attrs["probed_rtr"]
    assert outcome["queued"] and outcome["plan_id"] == r.plan_id and "probed_no_host" not in tuner.study.user_attrs
    assert t.params["rtr"] is True and r.measured is not None and r.measured.ok
    earlier = [u for u, s in recs if u.number < t.number and s.measured is not None and s.measured.ok
               and not u.params.get("rtr")]
    best = max(earlier, key=lambda u: TrialRecord.from_trial(u).measured.tg_tps)
    assert outcome["trial"] == best.number
    flipped = {k for k in set(t.params) | set(best.params) if t.params.get(k) != best.params.get(k)}
    assert "rtr" in flipped and flipped <= {"rtr", "mmap", "min_batch_log2", "only_active"}   # what -rtr settles
    assert "-rtr" in list(render(tuner.space.decode(tuner.space.fixed(t.params)).plan, inv, "server"))


def test_a_study_stored_before_no_host_resumes_with_the_space_it_had(qwen_on_16gib, tmp_path):
    inv, hw = qwen_on_16gib
    url = f"sqlite:///{tmp_path / 's.db'}"
    kw = dict(objective="tg", bench=WL, n_ctx=4096, storage=url, pool_size=10, study_name="old")
    study = Tuner(inv, hw, SimEngine(hw), StudyConfig(**kw)).study
    settings = study.user_attrs["settings"]
    del settings["space"]["no_host"]
    study.set_user_attr("settings", settings)
    resumed = Tuner(inv, hw, SimEngine(hw), StudyConfig(config=ON, **kw))      # what `tune` now asks for a real engine
    assert "no_host" not in resumed.space.dims and resumed.config.no_host == (False,)
    fresh = Tuner(inv, hw, SimEngine(hw), StudyConfig(config=ON, **dict(kw, study_name="new")))
    assert "no_host" in fresh.space.dims
    again = Tuner(inv, hw, SimEngine(hw), StudyConfig(config=ON, **dict(kw, study_name="new")))   # stored: kept
    assert "no_host" in again.space.dims


def test_a_full_fill_with_no_host_fits_its_budget():
    """mainline --no-host: RAM experts repack and never run on the GPU, so each expert the fill moves home brings
    its prompt compute onto the GPU and the fill's running total stops being an upper bound. On the H100
    benchmarks' model (Qwen3-30B-A3B shape, all Q4_0) at 12 GiB, ubatch 128, layers filled last-first, the
    no-host twin of the study's best run came out 70 MiB over, so the study's probe had nothing to run."""
    from planner.archs import build_inventory
    from planner.hardware import MiB
    from planner.presets import load_preset as preset
    from runtime.synth import uniform_recipe
    inv = build_inventory(preset("Qwen3-30B-A3B:Q8_0").spec, uniform_recipe("Q4_0"), name="synthetic")
    for gib in (8, 12, 16):
        space = Space(inv, load_hardware("gpu-box").with_vram([gib * GiB]), dialect="mainline", n_ctx=2112,
                      margin=64 * MiB, config=ON)
        for ubatch_log2 in (7, 9):
            for order in ("first", "last", "spread"):
                p = {**space.default_params(), "fill.CUDA0": 1.0, "order": order, "partial": True,
                     "no_host": True, "ubatch_log2": ubatch_log2}
                cand = space.decode(space.fixed(space.legal(p), default=lambda d: d.values[0]))
                assert cand.fits and cand.plan.knobs.no_host, (gib, ubatch_log2, order)
                assert any(cand.plan.assignment[t.name] != "CPU" for t in inv.allocated() if t.is_expert)
