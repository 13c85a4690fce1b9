"""The reference points every study measures beside its own trials, so a user sees what the tuner gains over
what llama.cpp already does by itself:

- `--fit`: the engine's own fitting (llama.cpp's `--fit` through llama-bench `-fitt`), when the engine has one
  (`engine.own_fit`); the sim and torch engines have none and get the "--fit-like fill" imitation instead,
  labelled so: experts on the CPU, then filled back to front, as llama.cpp's fit moves them;
- `-ngl 99 -cmoe`: every expert in RAM, the usual first command line;
- `--fit` as a server runs it: the placement llama-fit-params picks for the workload's whole context, measured
  as a plan. llama-bench -fitt fits each of its tests on its own: its generation test gets a placement fitted to
  an n_gen-token context and ubatch (no prompt KV, a tiny compute buffer), hundreds of MiB more experts on the
  GPU than a server that takes the prompt can hold; this baseline is the like-for-like one;
- the best `-ngl 99 -ncmoe N` that fits: the smallest N the memory model keeps within the budget, then N+1, N+2
  while a run measures over it (a short bisection with the model as its first guess). With several GPUs it is the
  best hand `-ngl 99 -ncmoe N -ts a,b`: mainline's -ncmoe N keeps the experts of the *first* N layers in RAM, which
  all sit on CUDA0 under an even split, so a user moves more layers to CUDA0 with -ts until both GPUs are about
  equally full (`ncmoe_split`); ik spreads -ncmoe over the GPUs itself (flags/ik_split.py), and the same search
  finds its -ts.

`measure_baselines` measures them for a Tuner's study (Tuner.baselines calls it), each record stored as it is made.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from planner.engine_contract import EngineFit
from planner.errors import InputError
from planner.flags import parse, placement_text
from planner.model import ModelInventory
from planner.plan import Dialect, Knobs, Plan
from planner.propose import Room, proposals
from .interrupt import SIGINT
from .records import StudyRecord, measured_dict

if TYPE_CHECKING:
    from .measurer import Measurer

NCMOE_TRIES = 3           # -ncmoe runs at most: the model's guess and two steps up if it measured over budget
SERVER_FIT = "--fit's placement in a server"   # llama-fit-params' pick for the whole workload, run as a plan
FIT_LIKE = "--fit-like fill (imitation)"


def flag_plan(inv: ModelInventory, args: list[str], knobs: Knobs, dialect: Dialect, model_id: str,
              n_gpus: int | None = None) -> Plan:
    """The plan a placement command line means (-ngl/-ot/-cmoe/-ncmoe/-ts), with the study's knobs. `n_gpus`: the
    machine's GPUs (a line without -ts splits its layers over all of them, evenly as planner.flags assumes;
    without it the GPUs are inferred from the line, so `-ngl 99 -cmoe` would mean CUDA0 alone)."""
    parsed = parse(args, inv, dialect, n_gpus=n_gpus)
    return Plan(model_id, parsed.assignment, knobs, dialect, " ".join(args))


def named_as_emitted(rec: dict[str, Any], plan: Plan, inv: ModelInventory) -> dict[str, Any]:
    """REC named by the placement flags its command carries, so the name matches the command the report prints
    (`-ngl 99 -cmoe` is emitted `-ngl 49 -cmoe` on a 48-layer model; issue 40 item 11); the kind, not the name,
    says which baseline it is. A plan the server cannot express keeps the name it was made from."""
    try:
        return {**rec, "name": placement_text(plan, inv)}
    except InputError:
        return rec


def smallest_ncmoe(inv: ModelInventory, knobs: Knobs, dialect: Dialect, model_id: str,
                   fits: Callable[[Plan], bool]) -> int | None:
    """The smallest N for which `-ngl 99 -ncmoe N` fits (binary search: more experts in RAM never needs more
    VRAM), None when not even every expert in RAM fits."""
    n_moe = len(inv.moe_layers())
    if n_moe == 0:
        return None

    def ok(n: int) -> bool:
        try:
            return fits(flag_plan(inv, ["-ngl", "99", "-ncmoe", str(n)], knobs, dialect, model_id))
        except InputError:
            return False
    if not ok(inv.n_layer):
        return None
    return _smallest(ok, 0, inv.n_layer)


def _smallest(ok, lo: int, hi: int) -> int:
    """The smallest n in [lo, hi] with ok(n), ok monotone and ok(hi) true (a bisection)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def ncmoe_split(inv: ModelInventory, knobs: Knobs, dialect: Dialect, model_id: str,
                headroom: Callable[[Plan], int | None], n_gpus: int, start: int = 0
                ) -> tuple[int, tuple[int, ...] | None] | None:
    """The best hand `-ngl 99 -ncmoe N -ts a,b` on several GPUs: the smallest N >= start for which some -ts fits
    every GPU, with the -ts that leaves the most room on the fuller GPU. `headroom(plan)`: the least free budget
    over the GPUs (negative: over; None: the plan is invalid). -ts is searched as layer counts a,b for two GPUs
    (one slot per count: -ngl 99 puts the n_layer blocks and the output layer on the GPUs); more GPUs keep the even
    split (None). None when not even every expert in RAM fits."""
    n_moe = len(inv.moe_layers())
    if n_moe == 0 or n_gpus < 2:
        return None
    slots = inv.n_layer + 1

    def plan_of(n: int, ts: tuple[int, ...] | None) -> Plan | None:
        args = ["-ngl", "99", "-ncmoe", str(n)] + (["-ts", ",".join(map(str, ts))] if ts else [])
        try:
            return flag_plan(inv, args, knobs, dialect, model_id, n_gpus)
        except InputError:
            return None

    def room(n: int, ts: tuple[int, ...] | None) -> int | None:
        p = plan_of(n, ts)
        return None if p is None else headroom(p)

    def best_ts(n: int) -> tuple[int, tuple[int, ...] | None] | None:
        """(room, ts) of the best split for -ncmoe n: the most room on the fuller GPU."""
        if n_gpus != 2:
            r = room(n, None)
            return None if r is None else (r, None)
        cache: dict[int, int | None] = {}

        def r_of(a: int) -> int | None:
            if a not in cache:
                cache[a] = room(n, (a, slots - a))
            return cache[a]
        # the room on the fuller GPU rises while CUDA1 is the fuller one and falls once CUDA0 is: a bisection on
        # the sign of the slope finds the top (the memory model is monotone per GPU up to a few MiB of compute)
        lo, hi = 1, slots - 1
        while hi - lo > 2:
            mid = (lo + hi) // 2
            a, b = r_of(mid), r_of(mid + 1)
            if a is None or b is None:
                break
            if b >= a:
                lo = mid + 1
            else:
                hi = mid
        cands = [(r_of(a), a) for a in range(max(1, lo - 1), min(slots - 1, hi + 1) + 1)]
        good = [(r, a) for r, a in cands if r is not None]
        if not good:
            return None
        r, a = max(good, key=lambda x: (x[0], -abs(2 * x[1] - slots)))
        return r, (a, slots - a)

    def ok(n: int) -> bool:
        got = best_ts(n)
        return got is not None and got[0] >= 0
    top = inv.n_layer
    if not ok(top):
        return None
    if max(start, 0) > top:
        return None
    lo = _smallest(ok, max(start, 0), top)
    got = best_ts(lo)
    assert got is not None
    return lo, got[1]


# ---- a study's baselines ------------------------------------------------------------------------------------------

def measure_baselines(measurer: Measurer, deadline: float | None = None) -> list[dict[str, Any]]:
    """Measure the reference points once per study: the engine's own --fit (or, for an engine without one, the
    --fit-like fill, labelled an imitation), -ngl 99 -cmoe, and the best -ngl 99 -ncmoe N that fits. Each record
    is stored as it is made (a killed study resumes after the last one); once time.monotonic() passes `deadline`
    no further one starts (the list comes back unfinished, the study attr `baselines` unset: the next call goes
    on where this one stopped)."""
    rec = StudyRecord.of(measurer.study)
    if rec.baselines is not None:
        return rec.baselines or []
    out: list[dict[str, Any]] = list(rec.baselines_partial)
    done = {b["name"] for b in out}

    def keep(record: dict[str, Any]) -> None:
        out.append(record)
        StudyRecord.save(measurer.study, baselines_partial=out)

    def late() -> bool:
        return deadline is not None and time.monotonic() >= deadline

    knobs = measurer.default_knobs()
    model_id = measurer.settings.model_id
    if "--fit" not in done and FIT_LIKE not in done:
        with SIGINT.engine_run():          # Ctrl-C ends this run at once, as every measurement's (interrupt.py)
            budgets = Room.from_hardware(measurer.hw, measurer.margins.initial).gpus
            fit = measurer.engine.own_fit(measurer.inv, measurer.bench, budgets)
        if fit is not None:
            keep(fit_record(fit, measurer.margins.over(dict(fit.measurement.peak_bytes))))
            done.add("--fit")
            if fit.chosen_args:
                keep(server_fit_record(measurer, fit.chosen_args))
    if late():
        return out
    if "--fit" not in done and FIT_LIKE not in done:
        try:
            margin = measurer.space.margin_for(knobs.n_ubatch)
            fitlike = next((p.plan for p in proposals(measurer.inv, measurer.hw, knobs, measurer.dialect, margin)
                            if p.strategy == "experts-cpu+fill" and p.order == "last"), None)
            keep(measurer.plan_record(FIT_LIKE, "fit-like", fitlike, "" if fitlike else "no experts-cpu proposal"))
        except InputError as e:
            keep(measurer.plan_record(FIT_LIKE, "fit-like", None, str(e)))
    if late():
        return out
    if not any(b.get("kind") == "cmoe" for b in out):
        try:
            plan = flag_plan(measurer.inv, ["-ngl", "99", "-cmoe"], knobs, measurer.dialect, model_id, measurer.n_gpus)
            keep(named_as_emitted(measurer.plan_record("-ngl 99 -cmoe", "cmoe", plan), plan, measurer.inv))
        except InputError as e:
            keep(measurer.plan_record("-ngl 99 -cmoe", "cmoe", None, str(e)))
    if late():
        return out
    if not any(b.get("kind") == "ncmoe" for b in out):
        keep(_ncmoe_record(measurer, knobs))
    StudyRecord.save(measurer.study, baselines=out)
    measurer.refit()
    return out


def server_fit_record(measurer: Measurer, chosen_args: list[str]) -> dict[str, Any]:
    """llama.cpp's placement for a server (--fit's chosen arguments), run as a plan: a reference, so unjudged."""
    try:
        plan = flag_plan(measurer.inv, list(chosen_args), measurer.default_knobs(), measurer.dialect,
                         measurer.settings.model_id, measurer.n_gpus)
        return measurer.plan_record(SERVER_FIT, "engine-fit-server", plan, judged=False)
    except InputError as e:
        return measurer.plan_record(SERVER_FIT, "engine-fit-server", None, str(e))


def _ncmoe_record(measurer: Measurer, knobs: Knobs) -> dict[str, Any]:
    """The best -ngl 99 -ncmoe N: the memory model's smallest N that fits, then N+1.. while runs measure
    over the budget (NCMOE_TRIES runs at most). Several GPUs: the best hand -ncmoe N -ts a,b (ncmoe_split)."""
    if measurer.n_gpus:
        return _ncmoe_split_record(measurer, knobs)
    inv, model_id = measurer.inv, measurer.settings.model_id

    def fits(plan: Plan) -> bool:
        return not measurer.over_budget(plan)
    n = smallest_ncmoe(inv, knobs, measurer.dialect, model_id, fits)
    if n is None:
        return {"name": "best -ncmoe", "kind": "ncmoe", "ok": False, "runs": 0,
                "error": "not run: not even -ncmoe with every layer fits the budget"}
    runs, rec = 0, {}
    for k in range(n, min(n + NCMOE_TRIES, inv.n_layer + 1)):
        plan = flag_plan(inv, ["-ngl", "99", "-ncmoe", str(k)], knobs, measurer.dialect, model_id)
        rec = named_as_emitted(measurer.plan_record(f"-ngl 99 -ncmoe {k}", "ncmoe", plan), plan, inv)
        runs += rec.get("runs", 0)
        rec.update(runs=runs, ncmoe=k)
        if rec["ok"] or not rec.get("runs") or "over the budget" not in (rec.get("error") or ""):
            break
    return rec


def _ncmoe_split_record(measurer: Measurer, knobs: Knobs) -> dict[str, Any]:
    """Several GPUs: -ngl 99 -ncmoe N -ts a,b with the smallest N that fits and the -ts that leaves the most
    room on the fuller GPU, then the next N (its own -ts) while runs measure over the budget."""
    inv, hw, model_id = measurer.inv, measurer.hw, measurer.settings.model_id

    def headroom(plan: Plan) -> int | None:
        mem = measurer.estimate(inv, plan, hw)
        if measurer.over_budget(plan, mem).startswith("host"):
            return -1
        budget = measurer.space.room_for(plan.knobs.n_ubatch).gpus
        return min(budget[g] - mem.gpu_total(g) for g in budget)
    runs, rec, start = 0, {}, 0
    for _ in range(NCMOE_TRIES):
        found = ncmoe_split(inv, knobs, measurer.dialect, model_id, headroom, len(hw.gpus), start)
        if found is None:
            if not rec:
                return {"name": "best -ncmoe -ts", "kind": "ncmoe", "ok": False, "runs": 0,
                        "error": "not run: not even -ncmoe with every layer fits the budget"}
            break
        n, ts = found
        args = ["-ngl", "99", "-ncmoe", str(n)] + (["-ts", ",".join(map(str, ts))] if ts else [])
        plan = flag_plan(inv, args, knobs, measurer.dialect, model_id, measurer.n_gpus)
        rec = named_as_emitted(measurer.plan_record(" ".join(args), "ncmoe", plan), plan, inv)
        runs += rec.get("runs", 0)
        rec.update(runs=runs, ncmoe=n, ts=list(ts) if ts else None)
        if rec["ok"] or not rec.get("runs") or "over the budget" not in (rec.get("error") or ""):
            break
        start = n + 1
    return rec


def fit_record(fit: EngineFit, over_budget: str) -> dict[str, Any]:
    """The engine's own --fit: its run (kept as measured; judged against the budget only to say so, in
    `over_budget`) and the arguments to run it again."""
    from planner.flags.common import shell_join
    m = fit.measurement
    rec: dict[str, Any] = {
        "name": "--fit", "kind": "engine-fit", "ok": bool(m.ok), "error": str(m.error or ""), "runs": 1,
        "measured": measured_dict(m), "argv": list(fit.argv), "env": dict(fit.env), "target_bytes": fit.target_bytes,
        "chosen_args": list(fit.chosen_args), "note": fit.note, "over_budget": over_budget,
        # keyed "llama-bench" (the benchmark's line) whatever the program: ik's is llama-sweep-bench
        "commands": {"llama-bench": shell_join([fit.program, *fit.argv], fit.env)},
        "label": "llama.cpp's own --fit" + (f" ({fit.note})" if fit.note else "")}
    if fit.chosen_args:
        rec["commands"]["llama-server"] = shell_join(["llama-server", "-m", "MODEL.gguf", *fit.chosen_args])
    return rec
