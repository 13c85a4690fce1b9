"""The candidate pool: decoded candidates of the space that fit, with their cost-model terms, ranked by the refitted
cost model. The study is seeded from it (the predicted Pareto front, the best per VRAM budget) and, every other
trial, takes its best unmeasured candidate ("surrogate"). Scorer says how the objective ranks speeds, and whether a
prediction is worth a run; the Pareto helpers (front, hypervolume improvement) are at the end.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Any

from planner.bench_run import BenchRun
from planner.hardware import GiB
from planner.host import host_bill
from planner.plan import Plan
from .cost_fit import CostFit, Terms
from .objectives import Objective
from .space import Candidate, Space

SCREEN_RATIO = 0.85        # measure a sampler candidate only if predicted >= this x the best measured
BUDGET_SHARES = (0.25, 0.5, 0.75, 1.0)


def budget_levels(total_vram: int) -> list[int]:
    """VRAM budgets the report lists a best config for: shares of all VRAM, rounded to whole GiB."""
    levels = sorted({max(GiB, int(round(total_vram * f / GiB)) * GiB) for f in BUDGET_SHARES})
    return [lv for lv in levels if lv <= max(total_vram, GiB)] or [total_vram]


@dataclass(frozen=True)
class Scorer:
    """The study's objective over speeds: one number per point, and what a prediction must reach to be run."""
    objective: Objective
    bench: BenchRun

    @property
    def pareto(self) -> bool:
        return self.objective.kind == "both"

    def score(self, tg: float, pp: float) -> float:
        """One number per point (the objective; the geometric mean for "both"); a speed the bench run does not
        measure (n_gen or n_prompt 0) counts as 0."""
        return self.objective.scalar(tg if self.bench.n_gen else 0.0, pp if self.bench.n_prompt else 0.0)

    def promising(self, tg: float, pp: float, measured: Sequence[tuple[float, float]]) -> tuple[bool, str]:
        """Whether predicted speeds are worth a run beside the `measured` (TG, PP) points, and if not, why."""
        if not measured:
            return True, ""
        if self.pareto:
            for mt, mp in measured:
                if tg <= SCREEN_RATIO * mt and pp <= SCREEN_RATIO * mp:
                    return False, (f"screened: predicted TG {tg:.2f} / PP {pp:.1f} t/s is dominated by measured "
                                   f"{mt:.2f} / {mp:.1f} with a {1 - SCREEN_RATIO:.0%} allowance")
            return True, ""
        best = max(self.score(a, b) for a, b in measured)
        s = self.score(tg, pp)
        if best > 0 and s < SCREEN_RATIO * best:
            return False, (f"screened: predicted {self.objective.text} {s:.4g} < {SCREEN_RATIO} x best measured "
                           f"{best:.4g}")
        return True, ""

    def improves(self, tg: float, pp: float, measured: Sequence[tuple[float, float]]) -> bool:
        """A measured point beyond the others: off their front ("both"), else above their best score."""
        if not measured:
            return True
        if self.pareto:
            return not any(a >= tg and b >= pp for a, b in measured)
        return self.score(tg, pp) > max(self.score(a, b) for a, b in measured)


@dataclass
class PoolEntry:
    params: dict[str, Any]
    plan_id: str
    terms: Terms
    gpu_bytes: dict[str, int]
    host_need: int
    n_ubatch: int


class Pool:
    """Candidates by plan id. `terms` prices a plan for the cost model; `rng` draws the random ones."""

    def __init__(self, terms: Callable[[Plan], Terms], rng: random.Random) -> None:
        self.terms, self.rng = terms, rng
        self.entries: dict[str, PoolEntry] = {}

    def get(self, plan_id: str) -> PoolEntry | None:
        return self.entries.get(plan_id)

    def add(self, cand: Candidate) -> None:
        if not cand.fits or cand.key in self.entries or cand.memory is None:
            return
        host = host_bill(cand.memory, 0).need      # the host bill Space.over_budget holds to the RAM
        self.entries[cand.key] = PoolEntry(dict(cand.params), cand.key, self.terms(cand.plan), cand.gpu_bytes(),
                                           host, cand.plan.knobs.n_ubatch)

    def build(self, space: Space, size: int) -> None:
        from .interrupt import SIGINT
        for _ in range(size):
            SIGINT.check()        # seconds of decoding as a study starts: a Ctrl-C (a service's stop) ends it here
            self.add(space.decode(space.random(self.rng)))

    def add_neighbours(self, space: Space, params: dict[str, Any], limit: int = 40) -> None:
        nb = space.neighbours(params)
        self.rng.shuffle(nb)
        for p in nb[:limit]:
            self.add(space.decode(space.fixed(p, default=lambda d: d.values[0])))

    def fitting(self, space: Space) -> list[PoolEntry]:
        """The entries within the budget their ubatch is held to now (the margin may have moved since)."""
        out = []
        for e in self.entries.values():
            b = space.room_for(e.n_ubatch)
            if e.host_need <= b.host and all(v <= b.gpus.get(d, 0) for d, v in e.gpu_bytes.items()):
                out.append(e)
        return out

    def pick(self, space: Space, fit: CostFit, scorer: Scorer, samples: Sequence[tuple[Terms, float, float]],
             skip: Container[str], k: int = 1, optimism: float = 1.03) -> list[PoolEntry]:
        """The best candidates not in `skip` (measured or queued) under the refitted cost model: by predicted
        objective, or (for "both") by predicted hypervolume improvement over the measured front. `samples`:
        the study's runs (terms, TG, PP)."""
        cands = [e for e in self.fitting(space) if e.plan_id not in skip]
        if not cands:
            return []
        tg, pp = fit.predict_many([e.terms for e in cands])
        # candidates the model cannot tell apart from a measured plan (knobs it does not price) wait for the sampler
        mtg, mpp = fit.predict_many([t for t, _, _ in samples])
        seen = {_bin(a, b) for a, b in zip(mtg, mpp)}
        keep = [i for i in range(len(cands)) if _bin(tg[i], pp[i]) not in seen]
        cands, tg, pp = [cands[i] for i in keep], tg[keep], pp[keep]
        if not cands:
            return []
        measured = [(t, p) for _, t, p in samples]
        if scorer.pareto:
            front = pareto_front(measured)
            scale = (max([p[0] for p in front] + [float(tg.max()), 1e-9]),
                     max([p[1] for p in front] + [float(pp.max()), 1e-9]))
            scaled_front = [(x / scale[0], y / scale[1]) for x, y in front]
            scores = [hypervolume_gain((a * optimism / scale[0], b * optimism / scale[1]), scaled_front)
                      for a, b in zip(tg, pp)]
        else:
            scores = [scorer.score(a, b) for a, b in zip(tg, pp)]
        order = sorted(range(len(cands)), key=lambda i: -scores[i])
        if samples:
            if scorer.pareto and scores[order[0]] <= 0:
                return []     # the model expects nothing of the pool to extend the measured front
            if not scorer.pareto and not scorer.promising(tg[order[0]], pp[order[0]], measured)[0]:
                return []
        return [cands[i] for i in order[:k]]

    def front_seeds(self, space: Space, fit: CostFit, scorer: Scorer, k: int) -> list[PoolEntry]:
        """The cost model's predicted Pareto front (or top-k) of the pool, spread along the front."""
        cands = self.fitting(space)
        if not cands:
            return []
        tg, pp = fit.predict_many([e.terms for e in cands])
        if not scorer.pareto:
            order = sorted(range(len(cands)), key=lambda i: -scorer.score(tg[i], pp[i]))
            return [cands[i] for i in order[:k]]
        idx = front_indices(list(zip(tg.tolist(), pp.tolist())))
        idx.sort(key=lambda i: tg[i])
        if len(idx) <= k:
            return [cands[i] for i in idx]
        picks = sorted({round(j * (len(idx) - 1) / (k - 1)) for j in range(k)})
        return [cands[idx[j]] for j in picks]

    def budget_seeds(self, space: Space, fit: CostFit, scorer: Scorer, total_vram: int
                     ) -> list[tuple[int, PoolEntry]]:
        """For each smaller VRAM budget of the report (a quarter, half, three quarters of all VRAM), the pool's
        best predicted candidate that stays under it: the report's best-per-budget rows get measured points."""
        out = []
        fitting = self.fitting(space)
        for level in budget_levels(total_vram)[:-1]:
            cands = [e for e in fitting if sum(e.gpu_bytes.values()) <= level]
            if not cands:
                continue
            tg, pp = fit.predict_many([e.terms for e in cands])
            if scorer.pareto:     # the report lists the best TG and the best PP per budget
                keys = [lambda j, tg=tg, pp=pp: (tg[j], pp[j]), lambda j, tg=tg, pp=pp: (pp[j], tg[j])]
            else:
                keys = [lambda j, tg=tg, pp=pp: scorer.score(tg[j], pp[j])]
            for key in keys:
                out.append((level, cands[max(range(len(cands)), key=key)]))
        return out


# ---- Pareto helpers (both speeds maximised) -----------------------------------------------------------------------

def _bin(tg: float, pp: float) -> tuple[int, int]:
    """Predicted speeds equal to 0.1%."""
    return (round(math.log(max(tg, 1e-12)) * 1000), round(math.log(max(pp, 1e-12)) * 1000))


def front_indices(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated points (both coordinates maximised)."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    out, best_pp = [], -math.inf
    for i in order:
        if points[i][1] > best_pp:
            out.append(i)
            best_pp = points[i][1]
    return out


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [points[i] for i in front_indices(points)]


def hypervolume_gain(p: tuple[float, float], front: list[tuple[float, float]]) -> float:
    """Hypervolume (reference 0,0) that point p adds to `front` (both maximised)."""
    def hv(pts: list[tuple[float, float]]) -> float:
        pts = pareto_front(pts)
        pts.sort(key=lambda x: -x[0])
        area, prev_y = 0.0, 0.0
        for x, y in pts:
            if y > prev_y:
                area += x * (y - prev_y)
                prev_y = y
        return area
    return hv(front + [p]) - hv(front)
