"""Refitting the cost model from measurements while a study runs.

planner.cost.predict sums roofline terms (seconds) that each scale with one coefficient of the hardware profile:
GPU reads and GPU compute with 1/gpu_eff and 1/GPU rate, CPU reads and compute with 1/cpu_eff and 1/host rate,
weight uploads with 1/link bandwidth, launches and splits with the Overheads' fixed costs. Grouping the terms
that share a coefficient makes the predicted time *linear* in one multiplier per group:

    tg_s(plan) = sum_g theta_tg[g] * T_g(plan)        g in gpu, cpu, fixed
    pp_s(plan) = sum_g theta_pp[g] * P_g(plan)        g in gpu, cpu, link, fixed

so a fit is a small bounded linear least-squares problem (rows: relative error of each measurement; a ridge
pulls every multiplier towards 1, the prior profile, so a handful of measurements cannot run away). The
multipliers map back onto the profile (gpu_eff / theta, link bandwidth / theta, ...) for reports.

A term (planner.cost_terms.Term) joins its group by kind (group_of): read, kv, compute, attn and output by their
device (a GPU's -> gpu, the CPU's -> cpu), upload -> link, upload_calls, sync and launch -> fixed. The stored form
of a trial's terms (Terms.to_dict) is seconds per group, the group names as above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any
from collections.abc import Iterable

import numpy as np

from planner.cost import Prediction
from planner.cost_terms import DEVICE_KINDS, Term
from planner.hardware import HardwareProfile

TG_GROUPS: tuple[str, ...] = ("gpu", "cpu", "fixed")
PP_GROUPS: tuple[str, ...] = ("gpu", "cpu", "link", "fixed")
THETA_BOUNDS = (0.1, 10.0)
RIDGE = 0.05          # weight of "theta = 1" against one measurement's relative error


# The coefficient each machine-wide kind scales with; per-device kinds scale with their device's (gpu or cpu).
MACHINE_GROUPS: dict[str, str] = {"upload": "link", "upload_calls": "fixed", "sync": "fixed", "launch": "fixed"}


def group_of(term: Term) -> str:
    """The coefficient group of a cost term, by its kind (and a per-device kind's device): no text is parsed, and a
    kind without a group is an error, never "fixed" by default."""
    if not isinstance(term, Term):
        raise TypeError(f"cost terms are keyed by planner.cost_terms.Term, not {type(term).__name__} ({term!r})")
    if term.kind in DEVICE_KINDS:
        return "gpu" if term.on_gpu else "cpu"
    group = MACHINE_GROUPS.get(term.kind)
    if group is None:
        raise ValueError(f"cost term {term} (kind {term.kind!r}) has no coefficient group in the refit")
    return group


@dataclass(frozen=True)
class Terms:
    """A prediction reduced to seconds per coefficient group, plus what turns seconds back into t/s."""
    tg: dict[str, float]
    pp: dict[str, float]
    pp_tokens: float        # pp_tps * pp_ubatch_s of the prior: tokens per ubatch-second unit

    @classmethod
    def of(cls, pred: Prediction) -> Terms:
        tg = {g: 0.0 for g in TG_GROUPS}
        pp = {g: 0.0 for g in PP_GROUPS}
        for phase, terms, groups in (("TG", pred.tg_terms, tg), ("PP", pred.pp_terms, pp)):
            for term, s in terms.items():
                g = group_of(term)
                if g not in groups:      # TG has no link coefficient: a token uploads no weights
                    raise ValueError(f"{phase} cost term {term} falls in group {g!r}, which {phase} does not fit")
                groups[g] += s
        return cls(tg, pp, pred.pp_tps * pred.pp_ubatch_s)

    def to_dict(self) -> dict[str, Any]:
        return {"tg": self.tg, "pp": self.pp, "pp_tokens": self.pp_tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Terms:
        tg, pp = dict(d["tg"]), dict(d["pp"])
        if set(tg) != set(TG_GROUPS) or set(pp) != set(PP_GROUPS):     # predict() would miss or drop a group
            raise ValueError(f"terms with groups TG {sorted(tg)}, PP {sorted(pp)}; expected TG {list(TG_GROUPS)}, "
                             f"PP {list(PP_GROUPS)}")
        return cls(tg, pp, float(d["pp_tokens"]))


@dataclass(frozen=True)
class CostFit:
    """One multiplier per group (1.0 = the prior profile) and how well prior and fit explain the data."""
    tg: dict[str, float] = field(default_factory=lambda: {g: 1.0 for g in TG_GROUPS})
    pp: dict[str, float] = field(default_factory=lambda: {g: 1.0 for g in PP_GROUPS})
    n: int = 0
    err_prior: dict[str, float] = field(default_factory=dict)   # mean |pred / measured - 1|, TG and PP
    err_fit: dict[str, float] = field(default_factory=dict)

    def predict(self, t: Terms) -> tuple[float, float]:
        """(tg_tps, pp_tps) under the fitted multipliers."""
        tg_s = sum(self.tg[g] * t.tg[g] for g in TG_GROUPS)
        pp_s = sum(self.pp[g] * t.pp[g] for g in PP_GROUPS)
        return (1.0 / tg_s if tg_s > 0 else 0.0, t.pp_tokens / pp_s if pp_s > 0 else 0.0)

    def predict_many(self, terms: list[Terms]) -> tuple[np.ndarray, np.ndarray]:
        if not terms:
            return np.zeros(0), np.zeros(0)
        T = np.array([[t.tg[g] for g in TG_GROUPS] for t in terms])
        P = np.array([[t.pp[g] for g in PP_GROUPS] for t in terms])
        k = np.array([t.pp_tokens for t in terms])
        tg_s = T @ np.array([self.tg[g] for g in TG_GROUPS])
        pp_s = P @ np.array([self.pp[g] for g in PP_GROUPS])
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(tg_s > 0, 1.0 / tg_s, 0.0), np.where(pp_s > 0, k / pp_s, 0.0)

    def moves(self) -> dict[str, float]:
        """How far the fit moved each term group from the prior: multiplier - 1 ("tg.cpu": +0.2 = the CPU's TG
        seconds are 20% longer than the prior profile says)."""
        return {f"tg.{g}": self.tg[g] - 1.0 for g in TG_GROUPS} | {f"pp.{g}": self.pp[g] - 1.0 for g in PP_GROUPS}

    def describe_moves(self) -> str:
        """The multipliers that moved, for one line of a report: 'TG cpu x1.21, PP link x0.87' ('none')."""
        parts = [f"{k.split('.')[0].upper()} {k.split('.')[1]} x{1 + v:.2f}" for k, v in self.moves().items()
                 if abs(v) >= 0.005]
        return ", ".join(parts) or "none"

    def to_dict(self) -> dict[str, Any]:
        return {"tg": self.tg, "pp": self.pp, "n": self.n, "err_prior": self.err_prior, "err_fit": self.err_fit,
                "moves": self.moves()}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> CostFit:
        if not d:
            return cls()
        return cls(dict(d["tg"]), dict(d["pp"]), int(d.get("n", 0)), dict(d.get("err_prior", {})),
                   dict(d.get("err_fit", {})))

    def hardware(self, hw: HardwareProfile) -> HardwareProfile:
        """The prior profile with the multipliers folded in (approximate where a term is a max of two)."""
        ov = hw.overheads
        ov = replace(ov, gpu_eff=ov.gpu_eff / self.tg["gpu"], cpu_eff=ov.cpu_eff / self.tg["cpu"],
                     per_split_s=ov.per_split_s * self.tg["fixed"],
                     per_layer_gpu_s=ov.per_layer_gpu_s * self.tg["fixed"],
                     per_layer_cpu_s=ov.per_layer_cpu_s * self.tg["fixed"])
        gpus = tuple(replace(g, flops=g.flops / self.pp["gpu"]) for g in hw.gpus)
        host = replace(hw.host, flops=hw.host.flops / self.pp["cpu"])
        link = replace(hw.link, h2d_pinned=hw.link.h2d_pinned / self.pp["link"],
                       h2d_pageable=hw.link.h2d_pageable / self.pp["link"])
        return replace(hw, gpus=gpus, host=host, link=link, overheads=ov, name=f"{hw.name} (refit, {self.n} runs)")


def _solve(rows: list[list[float]], ridge: float) -> list[float]:
    from scipy.optimize import lsq_linear
    A = np.array(rows, dtype=float)
    k = A.shape[1]
    A = np.vstack([A, math.sqrt(ridge) * np.eye(k)])
    b = np.concatenate([np.ones(len(rows)), math.sqrt(ridge) * np.ones(k)])
    res = lsq_linear(A, b, bounds=THETA_BOUNDS)
    return [float(x) for x in res.x]


def fit(samples: Iterable[tuple[Terms, float, float]], ridge: float = RIDGE) -> CostFit:
    """Fit multipliers to (terms, measured tg_tps, measured pp_tps) samples; a speed <= 0 is left out (not
    measured, e.g. n_gen = 0). Rows are relative: sum_g theta_g * term_g / measured_seconds = 1."""
    tg_rows, pp_rows, pairs = [], [], []
    for t, tg, pp in samples:
        if tg > 0:
            tg_rows.append([t.tg[g] * tg for g in TG_GROUPS])
        if pp > 0 and t.pp_tokens > 0:
            pp_rows.append([t.pp[g] * pp / t.pp_tokens for g in PP_GROUPS])
        pairs.append((t, tg, pp))
    out = CostFit(n=len(pairs))
    if tg_rows:
        out = replace(out, tg=dict(zip(TG_GROUPS, _solve(tg_rows, ridge))))
    if pp_rows:
        out = replace(out, pp=dict(zip(PP_GROUPS, _solve(pp_rows, ridge))))
    return replace(out, err_prior=_errors(CostFit(), pairs), err_fit=_errors(out, pairs))


def _errors(f: CostFit, pairs: list[tuple[Terms, float, float]]) -> dict[str, float]:
    e_tg, e_pp = [], []
    for t, tg, pp in pairs:
        ptg, ppp = f.predict(t)
        if tg > 0:
            e_tg.append(abs(ptg / tg - 1))
        if pp > 0:
            e_pp.append(abs(ppp / pp - 1))
    out = {}
    if e_tg:
        out["tg"] = float(np.mean(e_tg))
    if e_pp:
        out["pp"] = float(np.mean(e_pp))
    return out
