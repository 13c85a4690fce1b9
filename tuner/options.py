"""What a study is made with: StudyConfig (how the Tuner makes and searches it) and Settings (what it was made for,
stored with it: a resumed study must match, else it would mix incomparable trials).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from planner.bench_run import BenchRun
from planner.hardware import HardwareProfile
from planner.plan import Dialect
from planner.workload import Workload
from .objectives import Objective
from .space import Space, SpaceConfig
from .stored import StoredRow


@dataclass(frozen=True)
class StudyConfig:
    """How a study is made and searched (Tuner's options); the defaults are `tune`'s where it has one. Switching
    prescreen, surrogate and seed_trials off (and sampler="random") gives the plain baselines the benchmark
    compares with."""
    model: str = ""                          # the model as named (the settings' model; default: the inventory's)
    objective: Objective | str = "tg"
    bench: BenchRun = BenchRun(n_prompt=2048)
    dialect: Dialect = "mainline"
    n_ctx: int | None = None                 # the emitted --ctx (None: the workload's, at least DEFAULT_CTX)
    margin: int | None = None                # bytes under each GPU's VRAM; None: learnt (tuner.margin)
    config: SpaceConfig = SpaceConfig()
    requests: Workload | None = None         # the user's workload, which objective "time" serves
    study_name: str = "study"
    storage: str | None = None               # an SQLAlchemy URL; None keeps the study in memory
    fresh: bool = False                      # delete a stored study of that name first
    seed: int = 0
    prescreen: bool | None = None            # skip poor sampler candidates (None: when the engine is not sim)
    surrogate: bool = True                   # enqueue the pool's best candidate every other trial
    seed_trials: bool = True                 # enqueue proposals, the predicted front, the best per budget
    sampler: str = "tpe"                     # or "random"
    pool_size: int = 200
    baselines: bool = True
    commands: bool = True                    # render each trial's command lines
    space: Space | None = None               # a prepared Space (benchmarks share a cached grid between methods)


@dataclass(frozen=True)
class Settings(StoredRow):
    """What a study was made for, stored with it; a resumed study must match (else it would mix incomparable
    trials). Read back with from_dict, which takes any study's settings (tuner.stored: a key an older
    offload-tuner did not store reads as its default and stays absent when written back)."""
    # the bench run is stored under "workload", its name in every study stored before the bench run and the
    # user's workload had names of their own
    KEYS = {"bench": "workload"}
    READ = {"model": str, "model_id": str, "engine": str, "hardware": dict, "dialect": str, "objective": str,
            "bench": lambda d: BenchRun(**d), "n_ctx": int, "space": dict,
            "requests": lambda d: None if d is None else dict(d)}
    WRITE = {"bench": asdict}
    model: str = ""
    model_id: str = ""
    engine: str = ""
    hardware: dict[str, Any] = field(default_factory=dict)     # hardware_key's shape
    dialect: str = ""
    objective: str = ""
    bench: BenchRun = BenchRun()
    n_ctx: int = 0
    space: dict[str, Any] = field(default_factory=dict)        # SpaceConfig as stored (lists, not tuples)
    requests: dict[str, Any] | None = None     # the user's workload the time objective serves (None: other ones)
    absent: frozenset[str] = field(default=frozenset(), compare=False, repr=False)    # keys the study lacks

    def differences(self, other: Settings) -> list[str]:
        """The settings that make `other` (a stored study's) another study. A space option added after the
        study was made is absent from it: the study ran with that option's default, so the default matches."""
        mine, theirs_all = self.to_dict(), other.to_dict()
        out = []
        for name in ("model_id", "engine", "hardware", "dialect", "objective", "bench", "n_ctx", "space", "requests"):
            k = self.KEYS.get(name, name)
            theirs, ours = theirs_all.get(k), mine[k]
            if k == "space" and isinstance(theirs, dict):
                defaults = json.loads(json.dumps(asdict(SpaceConfig())))    # as stored: lists, not tuples
                theirs = {f: theirs.get(f, defaults.get(f)) for f in ours}
            if k == "hardware" and isinstance(theirs, dict) and "keep_free" not in theirs:
                theirs = {**theirs, "keep_free": ours["keep_free"]}   # stored before keep_free: resumes with it
            if k == "requests" and isinstance(theirs, dict) and ours and not any(
                    "longest_tokens" in c for c in theirs.get("classes", [])):      # a log folded before the field
                ours = {**ours, "classes": [{f: v for f, v in c.items() if f != "longest_tokens"}
                                            for c in ours.get("classes", [])]}
            if theirs != ours:
                out.append("bench run" if name == "bench" else name)
        return out


# SpaceConfig options that only widen the space, added after studies were stored: a study without one keeps its
# default (Tuner._keep_old_space). Not op_per_class: an old ik llama-bench study cannot go on without it.
LATER_SPACE_OPTIONS = ("no_host",)


def hardware_key(hw: HardwareProfile) -> dict[str, Any]:
    """The machine as a study's settings store it: its name, each GPU's name and memory, the host's RAM, and the
    GPU memory kept free on each GPU."""
    return {"name": hw.name, "gpus": [[g.name, g.vram_bytes] for g in hw.gpus], "host_ram": hw.host.ram_bytes,
            "keep_free": hw.keep_free_bytes}
