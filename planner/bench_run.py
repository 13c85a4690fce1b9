"""What one benchmark run measures (BenchRun): a prompt of n_prompt tokens (PP), n_gen greedy steps (TG)
after a prompt of depth tokens, repeated; what a user's requests look like is planner.workload's Workload.
Defined here, on the planner side, so the tuner and every engine (planner.engine_contract re-exports it) share one
type; planner never imports runtime."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError


@dataclass(frozen=True)
class BenchRun:
    n_prompt: int = 512
    n_gen: int = 128
    depth: int = 0
    repetitions: int = 3

    def __post_init__(self) -> None:
        if self.n_prompt < 0 or self.n_gen < 0 or self.depth < 0 or self.repetitions < 1:
            raise InputError(f"bad bench run {self}: token counts must be >= 0 and repetitions >= 1")
        if self.n_prompt == 0 and self.n_gen == 0:
            raise InputError("bad bench run: n_prompt and n_gen are both 0, nothing to measure")

    def rep_seconds(self, pp_tps: float, tg_tps: float) -> float:
        """The seconds one timed repetition takes at these speeds: its prompt and its generated tokens."""
        return (self.n_prompt / pp_tps if pp_tps > 0 else 0.0) + (self.n_gen / tg_tps if tg_tps > 0 else 0.0)

    def token_seconds(self, pp_tps: float, tg_tps: float) -> float:
        """The seconds a llama-bench run of this workload spends on tokens at these speeds: the warm-up prompt
        and token, the depth (filled once a run), each repetition. The rest of a run (loading the model, setting
        up) is not in it."""
        warm_up = (((self.n_prompt + self.depth) / pp_tps if pp_tps > 0 else 0.0)
                   + (1 / tg_tps if tg_tps > 0 and self.n_gen else 0.0))
        return warm_up + self.repetitions * self.rep_seconds(pp_tps, tg_tps)

    def seconds_at(self, seconds: float, pp_tps: float, tg_tps: float, repetitions: int) -> float:
        """The wall time of a run measured at this workload (`seconds`, at `pp_tps` / `tg_tps`) had it run
        `repetitions` times: only the timed prompt and generation repeat. Loading, the warm-up and the depth
        prefill happen once a run (llama-bench fills the depth once and restores it for later repetitions), so
        scaling the whole run by repetitions misjudged a --no-host run at depth 8192 (143 s at -r 3, ~110 s at
        -r 1, not 48; H100, 2026-11-24). At most the whole run repeats (speeds of another tool's counting)."""
        per_rep = min(self.rep_seconds(pp_tps, tg_tps), seconds / self.repetitions)
        return seconds - (self.repetitions - repetitions) * per_rep
