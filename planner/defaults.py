"""The command line's and the tuner's defaults in one place: the requests (offload_tuner/app/requests.py: their defaults
and help), the study-spec loader and the `run` command read them from here instead of repeating the numbers.

Defaults that belong to one module's own model stay there and are only named here: DEFAULT_CTX (planner.plan, the
context emitted commands hold), DEFAULT_MARGIN (planner.propose, the library's margin when none is given) and
CONFIRM_ROUNDS (tuner.confirm)."""
from __future__ import annotations

from typing import Final

from .plan import DEFAULT_CTX
from .bench_run import BenchRun
from .hardware import KEEP_FREE as KEEP_FREE_BYTES, MiB

SPACE_MODES: Final = ("settled", "full")

TUNE_ENGINE: Final = "sim"
TUNE_TRIALS: Final = 40                 # engine runs a `tune` session adds
TUNE_OBJECTIVE: Final = "time"          # the workload's mean request time (tuner/objectives.py)
TUNE_REQUESTS: Final = "chat"           # the user's workload (planner/workload.py's presets, a TOML or JSONL file)
# the benchmark run of a study under tg/pp/both/an expression: a 2048-token prompt (PP) and 128 generated tokens
# (TG) at depth 0, 3 repetitions (under time it is the workload's mean request, objectives.bench_for)
TUNE_WORKLOAD: Final = BenchRun(n_prompt=2048, n_gen=128, depth=0, repetitions=3)
TUNE_MARGIN: Final = "auto"             # learnt from the runs (docs/tuning.md)
TUNE_KV_TYPES: Final = ("f16", "q8_0")  # KV cache types the search may use
TUNE_SEED: Final = 0
TUNE_POOL: Final = 200                  # candidates the cost model pre-screens per trial
RUN_TIMEOUT_S: Final = 900.0            # seconds per llama-bench run (tune and run)
RUN_WORKLOAD: Final = BenchRun()        # `run` without -p/-n: llama-bench's own pp512 / tg128, 3 reps

# GPU memory kept free on each GPU, in every command and the service, for every engine (planner.hardware.KEEP_FREE:
# llama.cpp's own fit keeps as much free by default)
KEEP_FREE: Final = f"{KEEP_FREE_BYTES // MiB}MiB"
PLAN_MARGIN: Final = "0"                # `plan --margin`: beyond KEEP_FREE (tune learns its own: TUNE_MARGIN)
PLAN_TOP: Final = 8
PLAN_OBJECTIVE: Final = TUNE_OBJECTIVE  # `plan` ranks as tune does: the workload's (TUNE_REQUESTS) mean request time

# The largest value each count takes (offload_tuner/app/requests.py: the requests check them, so the CLI, a JSON body
# and a study spec refuse the same values; `run` checks its own in runtime/run.py). Each is far past any real use;
# without one a typo runs for ever or ends in a traceback deep inside a library.
MAX_SEED: Final = 2**32 - 1             # numpy's and Optuna's samplers take seeds 0 to 2**32-1 (else ValueError)
MAX_POOL: Final = 10_000                # pre-screened candidates: each decode is a memory estimate and the cost
                                        # model's terms (10-30 ms on a desktop core), so 10000 is minutes before
                                        # the first run, 50x the default; a pool of 10**12 never ended
MAX_TRIALS: Final = 100_000             # engine runs of one session (the service's --max-trials is within it)
MAX_CONFIRM: Final = 100                # confirmation rounds: each re-measures every finalist and the reference
MAX_REPS: Final = 1000                  # repetitions of one measurement (llama-bench -r)
MAX_TOKENS: Final = 1 << 24             # prompt, generated, depth, context, batch and ubatch tokens: 16M, above the
                                        # longest context any model trains for (10M); llama.cpp counts in 32 bits
MAX_THREADS: Final = 512                # ggml's GGML_MAX_N_THREADS
MAX_AMB_MIB: Final = 1 << 20            # ik's -amb in MiB: 1 TiB, more than any GPU holds
MAX_TOP: Final = 1000                   # plan --top: candidates listed
MAX_TIMEOUT_S: Final = 7 * 86400.0      # seconds one measurement may take: a week (finite: nan or inf would disable
                                        # the limit, and a hung engine would hold the study for ever)

__all__ = ["DEFAULT_CTX", "SPACE_MODES", "TUNE_ENGINE", "TUNE_TRIALS", "TUNE_OBJECTIVE", "TUNE_REQUESTS",
           "TUNE_WORKLOAD", "TUNE_MARGIN", "TUNE_KV_TYPES", "TUNE_SEED", "TUNE_POOL", "RUN_TIMEOUT_S", "RUN_WORKLOAD",
           "KEEP_FREE", "PLAN_MARGIN", "PLAN_TOP", "PLAN_OBJECTIVE", "MAX_SEED", "MAX_POOL", "MAX_TRIALS",
           "MAX_CONFIRM", "MAX_REPS", "MAX_TOKENS", "MAX_THREADS", "MAX_AMB_MIB", "MAX_TOP", "MAX_TIMEOUT_S"]
