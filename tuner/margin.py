"""A study's memory margin: how far under each GPU's VRAM the memory model must keep a plan, for its own error.

A fixed margin (`--margin SIZE`) is one number; an out-of-memory, or a run whose measured peak exceeds the budget
(VRAM minus that margin), raises it for every later trial. A learnt margin (the default) is per ubatch: an ubatch not
yet run is held to the engine's known error (the prior) or to what an out-of-memory raised the floor to; a measured
one to the largest under-prediction seen at it plus MARGIN_SLACK. It is stored in the study (StudyRecord's margin
fields), so a resumed study goes on with it.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.hardware import GiB, MiB, HardwareProfile
from planner.memory import DeviceMemory
from planner.plan import Plan, gpu_index, is_gpu
from planner.propose import Room
from .records import StudyRecord

OOM_STEP = 256 * MiB       # an OOM raises the margin by at least this much
MARGIN_SLACK = 64 * MiB    # learnt margin = the memory model's worst under-prediction so far + this
MAX_MARGIN_SHARE = 0.5     # ... but never above half of the smallest GPU


class Margins:
    """The margins of one study: `default` (an unmeasured ubatch's when learnt, else the fixed margin) and
    `by_ubatch` (a learnt margin's, per ubatch run). `changes` counts their changes: whoever built a Space on them
    builds it again when it moves."""

    def __init__(self, study: Any, hw: HardwareProfile, asked: int | None, prior: int) -> None:
        self.study, self.hw = study, hw
        self.asked = asked          # the margin asked for; None: learnt
        self.prior = prior          # the margin of an ubatch without runs: the asked one, else the engine's error
        rec = StudyRecord.of(study)
        if asked is None:
            self.default = max(prior, rec.margin_floor)
            self.by_ubatch: dict[int, int] = dict(rec.margin_by_ubatch)
        else:
            self.default = max(asked, rec.margin_bytes if rec.margin_bytes is not None else asked)
            self.by_ubatch = {}
        self.changes = 0

    @property
    def initial(self) -> int:
        """The margin runs are judged against: the one asked for (none when the margin is learnt)."""
        return self.asked if self.asked is not None else 0

    def room(self) -> dict[str, int]:
        """Each GPU's budget runs are judged against: VRAM minus the margin asked for."""
        return Room.from_hardware(self.hw, self.initial).gpus

    def over(self, peaks: Mapping[str, int]) -> str:
        """Which GPUs a reference run's peaks put over the budget ('' when none): said, never failed."""
        budget = self.room()
        return "; ".join(f"{d} {v / MiB:.0f} MiB > {budget[d] / MiB:.0f} MiB" for d, v in sorted(peaks.items())
                         if d in budget and v > budget[d])

    def for_ubatch(self, n_ubatch: int) -> int:
        return self.by_ubatch.get(n_ubatch, self.default)

    def judge(self, plan: Plan, peaks: Mapping[str, int], predicted: Mapping[str, DeviceMemory], at: str = "") -> str:
        """Learn from a run's GPU peaks (at the emitted context) what the memory model got wrong, and say
        whether a peak exceeds its GPU's budget: '' when none does, else the error naming the worst GPU (the
        largest excess). `at` says where the peaks were moved to (" at -c N"). With a fixed margin an
        over-budget run raises it by at least the excess (as an out-of-memory does).

        The budget here is VRAM minus the margin the study was asked for (none when the margin is learnt), not
        the current one: the current margin is the memory model's allowance for its own error, and judging runs
        against it would ratchet (an engine that holds a constant X bytes more than predicted would exceed every
        budget the margin moves to, by X, until the margin reached its cap)."""
        gap = max((p - predicted[d].total for d, p in peaks.items() if d in predicted), default=None)
        if gap is not None and self.asked is None:
            self.learn(plan, gap)
        budget = self.room()
        worst: tuple[int, str, int, int] | None = None
        for dev, peak in sorted(peaks.items()):
            have = budget.get(dev)
            if have is not None and peak > have and (worst is None or peak - have > worst[0]):
                worst = (peak - have, dev, int(peak), have)
        if worst is None:
            return ""
        _, dev, peak, have = worst
        vram = self.hw.gpu(dev).vram_bytes
        error = (f"measured peak {peak / GiB:.2f} GiB{at} on {dev} over the budget {have / GiB:.2f} GiB "
                 f"(VRAM {vram / GiB:.2f} GiB - margin {(vram - have) / MiB:.0f} MiB)")
        # later candidates are held to VRAM - (the asked margin + the model's error on this run), which this plan
        # no longer fits (a learnt margin has just taken that error in)
        if self.asked is not None:
            self.raise_for(plan, predicted, error, at_least=self.initial + max(gap or 0, 0))
        return error

    def learn(self, plan: Plan, gap: int) -> None:
        """The learnt margin of the plan's ubatch: the worst under-prediction (measured - predicted peak, worst
        GPU) seen at that ubatch in this study plus MARGIN_SLACK, never below what an out-of-memory raised the
        floor to. It moves both ways: a memory model exact at some ubatch frees its prior allowance for experts
        there. Per ubatch because the error is the compute buffer's: on the H100 (tune_vs_fit, 327 runs) the
        model never under-predicted by more than 4 MiB at ubatch <= 1024, by up to 29 MiB at 2048 and by up to
        92 MiB at 4096 with a deep context, so one margin learnt at 512 put a first 4096 run over its budget."""
        rec = StudyRecord.of(self.study)      # read each time: workers sharing a study add to the same lists
        ub = plan.knobs.n_ubatch
        by_ub = {k: list(v) for k, v in rec.memory_errors_by_ubatch.items()}
        errors = by_ub.setdefault(ub, [])
        errors.append(int(gap))
        StudyRecord.save(self.study, memory_errors=[*rec.memory_errors, int(gap)], memory_errors_by_ubatch=by_ub)
        worst = max(errors)
        # an engine the model never under-predicts (sim) needs no slack either
        new = min(max(worst + MARGIN_SLACK if worst > 0 else 0, rec.margin_floor), self._cap())
        if new != self.by_ubatch.get(ub):
            self._set(new, plan, f"ubatch {ub}: memory model error {gap / MiB:+.0f} MiB (worst at this "
                                 f"ubatch {worst / MiB:+.0f} MiB) + {MARGIN_SLACK // MiB} MiB", ubatch=ub)

    def raise_for(self, plan: Plan, predicted: Mapping[str, DeviceMemory], error: str, at_least: int = 0) -> None:
        """Raise the margin (for every later trial) so that `plan` (`predicted`: the memory model's bytes per
        device) no longer fits any GPU it failed on: by the predicted shortfall plus OOM_STEP, by at least
        OOM_STEP, and to at least `at_least` bytes; capped at MAX_MARGIN_SHARE of the smallest GPU. A learnt
        margin keeps it as the floor of every ubatch's."""
        step = OOM_STEP
        for dev, m in predicted.items():
            if is_gpu(dev) and gpu_index(dev) < len(self.hw.gpus):
                step = max(step, self.hw.gpu(dev).vram_bytes - m.total + OOM_STEP)
        ub = plan.knobs.n_ubatch
        current = self.for_ubatch(ub)
        cap = self._cap() if self.hw.gpus else current
        new = min(max(current + OOM_STEP, step, at_least), max(cap, current))
        if new <= current:
            return
        if self.asked is None:
            StudyRecord.save(self.study, margin_floor=new)
            for k, m in list(self.by_ubatch.items()):
                if m < new and k != ub:       # the plan's own: _set below, with its event
                    self.by_ubatch[k] = new
            if ub in self.by_ubatch:
                self._set(new, plan, error, ubatch=ub)
        if new > self.default:                # a fixed margin, or the floor now above an unmeasured ubatch's
            self._set(new, plan, error)

    def _cap(self) -> int:
        return int(MAX_MARGIN_SHARE * min(g.vram_bytes for g in self.hw.gpus)) if self.hw.gpus else 0

    def _set(self, new: int, plan: Plan, why: str, ubatch: int | None = None) -> None:
        """The margin of one ubatch (learnt), or the default one (an unmeasured ubatch's, or a fixed margin)."""
        before = self.default if ubatch is None else self.by_ubatch.get(ubatch, self.default)
        events = [*StudyRecord.of(self.study).margin_events,
                  {"from": before, "to": new, "plan_id": plan.id, "error": why[:200], "ubatch": ubatch}]
        if ubatch is None:
            self.default = new
        else:
            self.by_ubatch[ubatch] = new
        # both, always: raise_for may have floored other ubatches' margins before calling this
        StudyRecord.save(self.study, margin_bytes=self.default, margin_by_ubatch=dict(sorted(self.by_ubatch.items())),
                         margin_events=events)
        self.changes += 1
