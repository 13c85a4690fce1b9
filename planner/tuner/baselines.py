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
  while a run measures over it (a short bisection with the model as its first guess).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from ..errors import InputError
from ..flags import parse
from ..model import ModelInventory
from ..plan import Dialect, Knobs, Plan

NCMOE_TRIES = 3           # -ncmoe runs at most: the model's guess and two steps up if it measured over budget


@dataclass(frozen=True)
class EngineFit:
    """What an engine's own --fit did for a budget: its run, the arguments to run it again (confirmation), the
    free memory it was asked to leave, and (when the engine can say) the placement it chose."""
    measurement: Any                          # planner.engine.Measurement (or a stored MeasuredRun)
    argv: tuple[str, ...]                     # the benchmark's arguments after the program
    env: dict[str, str] = field(default_factory=dict)
    target_bytes: int = 0                     # -fitt: free memory llama.cpp must leave on each GPU
    chosen_args: tuple[str, ...] = ()         # the placement it chose, as server flags (llama-fit-params' for
                                              # mainline; ik's own log for ik)
    note: str = ""
    program: str = "llama-bench"              # the benchmark argv is for (ik: llama-sweep-bench)


def flag_plan(inv: ModelInventory, args: list[str], knobs: Knobs, dialect: Dialect, model_id: str) -> Plan:
    """The plan a placement command line means (-ngl/-ot/-cmoe/-ncmoe), with the study's knobs."""
    parsed = parse(args, inv, dialect)
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
    lo, hi = 0, inv.n_layer             # ok(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo
