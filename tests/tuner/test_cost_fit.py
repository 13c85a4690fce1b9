"""Refitting the cost model: the prior multipliers reproduce planner.cost.predict, and a fit on measurements of a
machine that differs from its profile brings the predictions close to that machine."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from planner.cost import Prediction, predict
from planner.cost_terms import DEVICE_KINDS, KINDS, Term
from tuner.cost_fit import MACHINE_GROUPS, PP_GROUPS, CostFit, Terms, fit, group_of
from planner.hardware import GiB, load_hardware
from planner.presets import load_preset
from tuner.space import Space


def _setup():
    inv = load_preset("Qwen3-30B-A3B:Q4_K_M").inventory()
    hw = load_hardware("desktop-ddr5").with_vram([16 * GiB])
    space = Space(inv, hw, n_ctx=8192)
    rng = random.Random(3)
    plans = [c.plan for c in (space.decode(space.random(rng)) for _ in range(14)) if c.fits]
    return inv, hw, plans


def test_prior_reproduces_predict_and_fit_learns_a_different_machine():
    inv, hw, plans = _setup()
    for p in plans[:3]:
        pr = predict(inv, p, hw, n_prompt=2048)
        tg, pp = CostFit().predict(Terms.of(pr))
        assert tg == pytest.approx(pr.tg_tps) and pp == pytest.approx(pr.pp_tps)
    ov = hw.overheads
    truth = replace(hw, host=replace(hw.host, mem_bw=hw.host.mem_bw * 0.6),
                    link=replace(hw.link, h2d_pinned=hw.link.h2d_pinned * 0.5, h2d_pageable=hw.link.h2d_pageable * 0.5),
                    overheads=replace(ov, gpu_eff=ov.gpu_eff * 0.8))
    train, test = plans[:8], plans[8:]
    samples = []
    for p in train:
        t = predict(inv, p, truth, n_prompt=2048)
        samples.append((Terms.of(predict(inv, p, hw, n_prompt=2048)), t.tg_tps, t.pp_tps))
    f = fit(samples)
    assert f.n == len(train)
    assert f.err_fit["tg"] < f.err_prior["tg"] / 3 and f.err_fit["pp"] < f.err_prior["pp"] / 2
    assert f.tg["cpu"] > 1.3 and f.pp["link"] > 1.3          # slower host memory and PCIe than the profile says
    for p in test:                                            # and it generalises to plans it has not seen
        t = predict(inv, p, truth, n_prompt=2048)
        tg, pp = f.predict(Terms.of(predict(inv, p, hw, n_prompt=2048)))
        assert tg == pytest.approx(t.tg_tps, rel=0.05) and pp == pytest.approx(t.pp_tps, rel=0.15)
    assert CostFit.from_dict(f.to_dict()) == f
    assert f.hardware(hw).link.h2d_pinned < hw.link.h2d_pinned


def test_the_fit_says_how_far_it_moved_each_term_group():
    f = CostFit(tg={"gpu": 1.0, "cpu": 1.25, "fixed": 1.0}, pp={"gpu": 0.8, "cpu": 1.0, "link": 1.0, "fixed": 1.0}, n=5)
    assert f.moves()["tg.cpu"] == pytest.approx(0.25) and f.moves()["pp.gpu"] == pytest.approx(-0.2)
    assert f.describe_moves() == "TG cpu x1.25, PP gpu x0.80"
    assert CostFit().describe_moves() == "none"
    assert CostFit.from_dict(f.to_dict()) == f and f.to_dict()["moves"]["tg.cpu"] == pytest.approx(0.25)


# ---- typed cost terms: the refit groups by kind -------------------------------------------------------------------

def _prediction(tg: dict, pp: dict) -> Prediction:
    return Prediction(pp_tps=512.0, tg_tps=10.0, tg_s=0.1, pp_ubatch_s=1.0, tg_terms=tg, pp_terms=pp)


def test_the_refit_groups_terms_by_kind_and_device():
    pred = _prediction({Term("read", "CUDA1"): 1.0, Term("kv", "CUDA0"): 0.5, Term("read", "CPU"): 2.0,
                        Term("kv", "CPU"): 0.25, Term("launch"): 3.0, Term("sync"): 4.0},
                       {Term("compute", "CUDA0"): 1.0, Term("attn", "CUDA2"): 1.0, Term("output", "CPU"): 0.5,
                        Term("compute", "CPU"): 2.0, Term("upload"): 7.0, Term("upload_calls"): 0.5,
                        Term("launch"): 0.25, Term("sync"): 0.25})
    t = Terms.of(pred)
    assert t.tg == {"gpu": 1.5, "cpu": 2.25, "fixed": 7.0}
    assert t.pp == {"gpu": 2.0, "cpu": 2.5, "link": 7.0, "fixed": 1.0}
    assert t.pp_tokens == 512.0
    # every kind there is has a group (a kind added to cost_terms without one fails here, not in a study)
    for kind in KINDS:
        term = Term(kind, "CUDA0") if kind in DEVICE_KINDS else Term(kind)
        assert group_of(term) in PP_GROUPS


def test_a_real_prediction_keeps_every_second_in_some_group():
    inv, hw, plans = _setup()
    pr = predict(inv, plans[0], hw, n_prompt=2048)
    t = Terms.of(pr)
    assert sum(t.tg.values()) == pytest.approx(pr.tg_s) and sum(t.pp.values()) == pytest.approx(pr.pp_ubatch_s)
    assert all(isinstance(k, Term) for k in [*pr.tg_terms, *pr.pp_terms])


@pytest.mark.parametrize("kind, device", [("memcpy", ""), ("memcpy", "CUDA0"), ("read", ""), ("read", "cuda0"),
                                          ("read", "Vulkan0"), ("launch", "CUDA0"), ("upload", "CPU")])
def test_a_cost_term_of_an_unknown_kind_or_a_wrong_device_is_rejected(kind, device):
    with pytest.raises(ValueError, match="cost term"):
        Term(kind, device)


def test_a_kind_without_a_group_or_a_text_key_is_an_error_not_fixed(monkeypatch):
    monkeypatch.delitem(MACHINE_GROUPS, "upload_calls")
    with pytest.raises(ValueError, match="no coefficient group"):
        Terms.of(_prediction({}, {Term("upload_calls"): 1.0}))
    monkeypatch.undo()
    with pytest.raises(TypeError, match="keyed by planner.cost_terms.Term"):
        Terms.of(_prediction({"CUDA0_read": 1.0}, {}))      # the old text keys are no longer read
    with pytest.raises(ValueError, match="TG does not fit"):
        Terms.of(_prediction({Term("upload"): 1.0}, {}))    # a token uploads no weights: TG has no link group


def test_terms_read_back_only_with_the_known_groups():
    t = Terms({"gpu": 1.0, "cpu": 2.0, "fixed": 3.0}, {"gpu": 1.0, "cpu": 2.0, "link": 3.0, "fixed": 4.0}, 512.0)
    assert Terms.from_dict(t.to_dict()) == t
    bad = t.to_dict() | {"tg": {"gpu": 1.0, "cpu": 2.0, "fixed": 3.0, "CUDA0_read": 1.0}}
    with pytest.raises(ValueError, match="expected TG"):
        Terms.from_dict(bad)
