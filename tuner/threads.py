"""The thread probe: before a measured study explores, a short generation run at llama.cpp's default thread count
and at half and three quarters of the machine's cores, on the plan the study starts from. When another count
generates at least THREADS_GAIN faster than the default, the study settles there and every contender runs at it,
the --fit references too; else at the default (no -t, what the user runs).

Why: llama.cpp's default -t is every core it counts, and on a 64-vCPU four-GPU VM that generated 0.6 t/s where -t 32
gave 12.8 (benchmarks/reported/threads_h200x4.md, docs/llamacpp.md section 13); a study settled at the default
there compares placements at a count 20x too slow, and so does its --fit. Hybrid and SMT CPUs show the same
(llama.cpp issue 28625, PR 29160). A count the user gave is kept, and not probed."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from planner.bench_run import BenchRun
from planner.model import ModelInventory
from planner.plan import Plan

THREADS_GAIN = 1.10          # another count must generate this much faster than the default to be taken
# a few generated tokens, no prompt, one repetition: the probe costs a model load and seconds of generation
PROBE_WORKLOAD = BenchRun(n_prompt=0, n_gen=16, depth=0, repetitions=1)


@dataclass(frozen=True)
class ThreadProbe:
    """The probe's runs: TG per thread count (0: llama.cpp's default, no -t), the count taken (0: the default)."""
    tg_tps: dict[int, float]             # a count whose run failed is absent
    errors: dict[int, str]
    pick: int

    def to_dict(self) -> dict[str, Any]:
        return {"tg_tps": {str(k): v for k, v in self.tg_tps.items()},
                "errors": {str(k): v for k, v in self.errors.items()}, "pick": self.pick}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ThreadProbe:
        return cls({int(k): float(v) for k, v in d.get("tg_tps", {}).items()},
                   {int(k): str(v) for k, v in d.get("errors", {}).items()}, int(d.get("pick", 0)))

    def line(self) -> str:
        """What the report's first lines say of it."""
        default = self.tg_tps.get(0)
        if self.pick == 0:
            best = max(self.tg_tps.values(), default=0.0)
            if default is None:
                return "threads: the probe's runs failed; every command here runs at llama.cpp's default -t"
            return (f"threads: llama.cpp's default -t generated {default:.1f} t/s here, no other count "
                    f"{THREADS_GAIN:.2f}x that (best {best:.1f} t/s): every command here runs at the default")
        said = f"{default:.1f} t/s" if default is not None else "nothing (its run failed)"
        return (f"threads: llama.cpp's default -t generated {said} here; -t {self.pick} "
                f"{self.tg_tps[self.pick]:.1f} t/s: every command here carries -t {self.pick}")


def probe_counts(cores: int | None = None) -> tuple[int, ...]:
    """0 (the default), half and three quarters of the cores, each once."""
    n = cores or os.cpu_count() or 1
    return tuple(dict.fromkeys(c for c in (0, max(1, n // 2), max(1, 3 * n // 4)) if c == 0 or c < n))


def decide(tg_tps: dict[int, float]) -> int:
    """The count the study settles at: the fastest, when it beats the default by THREADS_GAIN (or the default's
    run failed); else 0, the default."""
    others = {c: v for c, v in tg_tps.items() if c != 0 and v > 0}
    if not others:
        return 0
    best = max(others, key=lambda c: others[c])
    default = tg_tps.get(0, 0.0)
    return best if default <= 0 or others[best] >= THREADS_GAIN * default else 0


def probe_threads(measure: Callable[[ModelInventory, Plan, BenchRun], Any], inv: ModelInventory, plan: Plan,
                  counts: tuple[int, ...] | None = None,
                  say: Callable[[str], None] | None = None) -> ThreadProbe:
    """`measure` (an Engine's) of PLAN at each count of `counts` (probe_counts()), PROBE_WORKLOAD each."""
    tg, errors = {}, {}
    for n in counts or probe_counts():
        m = measure(inv, replace(plan, knobs=replace(plan.knobs, n_threads=n)), PROBE_WORKLOAD)
        if m.ok and m.tg_tps > 0:
            tg[n] = float(m.tg_tps)
        else:
            errors[n] = " ".join(str(m.error or "no speed").split())[:200]
        if say is not None:
            name = "the default -t" if n == 0 else f"-t {n}"
            say(f"# threads: {name}: " + (f"{tg[n]:.1f} t/s" if n in tg else f"failed ({errors[n]})"))
    return ThreadProbe(tg, errors, decide(tg))
