"""What an engine measures: a prompt of n_prompt tokens (PP), n_gen greedy steps (TG) after a prompt of depth
tokens, repeated. Defined here, on the planner side, so the tuner and every engine (planner.engine and
runtime.engine re-export it) share one type; planner never imports runtime."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError


@dataclass(frozen=True)
class Workload:
    n_prompt: int = 512
    n_gen: int = 128
    depth: int = 0
    repetitions: int = 3

    def __post_init__(self) -> None:
        if self.n_prompt < 0 or self.n_gen < 0 or self.depth < 0 or self.repetitions < 1:
            raise InputError(f"bad workload {self}: token counts must be >= 0 and repetitions >= 1")
        if self.n_prompt == 0 and self.n_gen == 0:
            raise InputError("bad workload: n_prompt and n_gen are both 0, nothing to measure")
