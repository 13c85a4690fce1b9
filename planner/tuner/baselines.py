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
"""
from __future__ import annotations

from collections.abc import Callable

from ..errors import InputError
from ..flags import parse
from ..model import ModelInventory
from ..plan import Dialect, Knobs, Plan

NCMOE_TRIES = 3           # -ncmoe runs at most: the model's guess and two steps up if it measured over budget


def flag_plan(inv: ModelInventory, args: list[str], knobs: Knobs, dialect: Dialect, model_id: str,
              n_gpus: int | None = None) -> Plan:
    """The plan a placement command line means (-ngl/-ot/-cmoe/-ncmoe/-ts), with the study's knobs. `n_gpus`: the
    machine's GPUs (a line without -ts splits its layers over all of them, evenly as planner.flags assumes;
    without it the GPUs are inferred from the line, so `-ngl 99 -cmoe` would mean CUDA0 alone)."""
    parsed = parse(args, inv, dialect, n_gpus=n_gpus)
    return Plan(model_id, parsed.assignment, knobs, dialect, " ".join(args))


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
