"""How a study is set up, in one place: its space (settled or full), the -t it settles at, what its engine adds or
takes away, and the llama-bench confirmation rounds after its search. `tune` (offload_tuner/app/tune.py, which the
CLI and the service run) and every benchmark that makes a study ask here, so a benchmark's cell is the study a
user's `tune` would have made (or says in its own docstring where it differs: a thread count of its own).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

from planner.engine_contract import Engine
from planner.engine_registry import traits_of
from planner.errors import InputError
from planner.plan import Dialect
from .confirm import CONFIRM_ROUNDS
from .space import SpaceConfig
from .threads import ThreadProbe

SpaceMode = Literal["settled", "full"]


@dataclass(frozen=True)
class StudySetup:
    """A study's configuration: its space, the -t its settled space carries (0: llama.cpp's default, no -t), the
    llama-bench confirmation rounds after the search, and the thread probe behind the -t (None: none ran)."""
    config: SpaceConfig
    threads: int
    rounds: int
    probe: ThreadProbe | None = None


def study_setup(engine: Engine, dialect: Dialect, *, space: SpaceMode | None = None,
                kv_types: tuple[str, ...] | None = None, limits: Mapping[str, tuple[Any, ...]] | None = None,
                threads: int | None = None, probe: Callable[[], ThreadProbe | None] | None = None,
                confirm: int | None = None, serving: bool = False) -> StudySetup:
    """The setup of a study run by `engine` in `dialect`.

    space: "settled" fixes the knobs that never reached the front (SpaceConfig.settled), the default for an
    engine whose runs cost time; "full" searches them too, the default for the sim engine (the model itself).
    threads: the -t a settled space carries; None: llama.cpp's default (what the user runs), unless `probe` (a
    llama-bench study whose threads the user left open) finds a count at least 10% faster (tuner/threads.py).
    limits: a spec's own SpaceConfig values, which win over the settled ones. confirm: the llama-bench rounds
    after the search; None: CONFIRM_ROUNDS for a measured engine, none where `serving` follows (the same
    finalists on the server the user runs: on one H200 the rounds took the minutes a 9-minute --time-limit had
    left for the serving) or for the sim engine (nothing to confirm)."""
    limits = dict(limits or {})
    measured = traits_of(engine).measured
    config = SpaceConfig() if kv_types is None else SpaceConfig(kv_types=kv_types)
    found = None
    if (space or ("settled" if measured else "full")) == "settled":
        if threads is None:
            open_threads = traits_of(engine).binary == "llama-bench" and "threads" not in limits
            found = probe() if probe is not None and open_threads else None
            threads = found.pick if found is not None else 0
        config = config.settled(threads, dialect)
    config = replace(config.for_engine(engine, dialect), **limits)  # --no-host, ik bench's one -op; then the spec's
    rounds = confirm if confirm is not None else (CONFIRM_ROUNDS if measured and not serving else 0)
    if rounds < 0:
        raise InputError(f"--confirm must be >= 0, got {rounds}")
    return StudySetup(config, threads or 0, rounds, found)
