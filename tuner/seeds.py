"""What a study enqueues besides the sampler's trials, once per study: the seed trials (every GPU filled with
experts, the planner's proposals, the default, the cost model's predicted front and the best per VRAM budget of
the pool) and the repack probes (the best-TG run again with --no-host / -rtr on). Tuner.enqueue_seeds and
Tuner.probe_repack call these with the study's Measurer and the search's candidate pool.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from planner.errors import InputError
from planner.hardware import GiB
from planner.propose import best_plans
from .records import StudyRecord, TrialRecord
from .space import Space

if TYPE_CHECKING:
    from .pool import Pool, Scorer
    from .measurer import Measurer

log = logging.getLogger(__name__)

# The knobs that repack the weights kept in RAM for the CPU's matmuls (TG up; those weights are never op-offloaded,
# so PP with experts in RAM falls): mainline's --no-host, ik's -rtr. Each has one probe per study, the best-TG run
# again with it on; the value is the probe trial's source (and the study attr is probed_<knob>).
REPACK_PROBES = {"no_host": "probe:no-host", "rtr": "probe:rtr"}
PROBE_NO_HOST, PROBE_RTR = REPACK_PROBES["no_host"], REPACK_PROBES["rtr"]


def enqueue_seeds(measurer: Measurer, pool: Pool, scorer: Scorer, max_seeds: int | None = None) -> int:
    """Enqueue the planner's proposals and the cost model's predicted front (once per study), at most
    `max_seeds` of them (None: all). Returns how many were enqueued."""
    if StudyRecord.of(measurer.study).seeded:
        return 0
    space = measurer.space
    seeds: list[tuple[dict[str, Any], str]] = fill_max_seeds(space, measurer.objective.kind)
    try:
        knobs = measurer.default_knobs()
        ranked = best_plans(measurer.inv, measurer.hw, knobs, measurer.dialect,
                            _planner_objective(measurer.objective.kind), space.margin_for(knobs.n_ubatch),
                            n_prompt=max(measurer.bench.n_prompt, 1))
    except InputError:
        ranked = []
    for s in ranked[:6]:
        seeds.append((space.proposal_params(s.proposal), f"proposal:{s.proposal.label}"))
    seeds.append((space.default_params(), "default"))
    for e in pool.front_seeds(space, measurer.fit, scorer, 6):
        seeds.append((e.params, "cost-front"))
    total_vram = sum(g.vram_bytes for g in measurer.hw.gpus)
    for level, e in pool.budget_seeds(space, measurer.fit, scorer, total_vram):
        seeds.append((e.params, f"budget:{level / GiB:.0f}GiB"))
    n, seen = 0, set(measurer.queued)
    for params, source in seeds:
        if max_seeds is not None and n >= max_seeds:
            break
        cand = space.decode(space.fixed(space.legal(params), default=lambda d: d.values[0]))
        pool.add(cand)
        if not cand.fits or cand.key in seen:
            continue
        seen.add(cand.key)
        measurer.enqueue(cand.params, cand.key, source)
        n += 1
    StudyRecord.save(measurer.study, seeded=True)
    return n


def _planner_objective(kind: str) -> str:
    return {"tg": "tg", "pp": "pp"}.get(kind, "both")


def fill_max_seeds(space: Space, objective_kind: str) -> list[tuple[dict[str, Any], str]]:
    """Every GPU filled with experts as far as the budget goes: for TG at the smallest ubatch (the least
    compute buffer, so the most experts; llama-bench's generation test caps its ubatch at its context anyway)
    and at 512; for PP at the largest two ubatches. TG rises with every expert tensor moved to VRAM, so these
    are where a TG study ends up."""
    d = space.dims
    if not any(name.startswith("fill.") for name in d):
        return []
    # the default (full-precision) KV: on the H100 runs of issue 10 a q8_0 cache cost ~10% TG at the same
    # placement (flash-attention decode over a quantized cache), more than the experts its room bought
    kv = space.default_params()["kv"]
    ubs = list(d["ubatch_log2"].values)
    wanted = [(ubs[0], "tg"), (d["ubatch_log2"].snap(9), "tg"), (ubs[-1], "pp"), (ubs[max(len(ubs) - 2, 0)], "pp")]
    if objective_kind == "pp":
        wanted.reverse()
    out = []
    for ub, why in dict.fromkeys(wanted):
        p = space.default_params()
        p.update({f"fill.{g}": 1.0 for g in space.gpus}, kv=kv, ubatch_log2=ub, order="last", partial=True)
        out.append((p, f"fill-max:{why}"))
    return out


def probe_repack(measurer: Measurer, pool: Pool) -> bool:
    """Once per study, when the space has a repacking dim (REPACK_PROBES: mainline's no_host, ik's rtr):
    enqueue the best-TG run so far again with it on (source REPACK_PROBES[knob]), so the knob gets one engine
    run on the plan where it could matter most (the sampler alone may never pair it with a good placement;
    --no-host configs were the confirmed best TG in most of the H100's tune_vs_fit cells, and ik's best 8 GiB
    config was an -rtr one that the sampler found in one study of two). Where that twin does not fit or ran
    already, the next-best TG run's twin. The outcome is kept in the study attr `probed_<knob>` (the trial it
    copies and the plan, or why none was queued), so a study without a probe says why. True when it enqueued
    one."""
    from optuna.trial import TrialState
    space, study = measurer.space, measurer.study
    knob = next((k for k in REPACK_PROBES if k in space.dims), None)
    if knob is None:
        return False
    if True not in space.dims[knob].values or not measurer.bench.n_gen or StudyRecord.of(study).probed(knob):
        return False
    runs: list[tuple[float, int, dict[str, Any]]] = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        m = TrialRecord.from_trial(t).measured
        if m is not None and m.ok and not t.params.get(knob):
            runs.append((m.tg_tps, t.number, dict(t.params)))
    if not runs:
        return False
    tried = set(measurer.queued) | {TrialRecord.from_trial(t).plan_id for t in study.get_trials(deepcopy=False)}
    outcome: dict[str, Any] = {"queued": False, "why": f"no run's {knob} twin fits and is new"}
    for tg, number, params in sorted(runs, key=lambda r: -r[0]):
        cand = space.decode(space.fixed(space.legal({**params, knob: True}), default=lambda d: d.values[0]))
        if not cand.fits or cand.key in measurer.measured or cand.key in tried:
            continue
        pool.add(cand)
        # enqueued before the mark: a study killed in between finds it waiting, not lost; not skipped where
        # an earlier trial (a screened one, say) had the same params
        study.enqueue_trial(cand.params, user_attrs=TrialRecord(source=REPACK_PROBES[knob],
                                                                plan_id=cand.key).to_attrs())
        measurer.queued.add(cand.key)
        outcome = {"queued": True, "trial": number, "tg_tps": tg, "plan_id": cand.key}
        break
    StudyRecord.save(study, **{f"probed_{knob}": outcome})
    log.debug("%s probe: %s", knob, outcome)
    return outcome["queued"]
