"""Refitting the cost model: the prior multipliers reproduce planner.cost.predict, and a fit on measurements of a
machine that differs from its profile brings the predictions close to that machine."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from planner.cost import predict
from planner.tuner.cost_fit import CostFit, Terms, fit
from planner.hardware import GiB, load_hardware
from planner.presets import load_preset
from planner.tuner.space import Space


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
