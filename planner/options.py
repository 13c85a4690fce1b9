"""Typed options of the commands that call other code with many settings: built once at the edge (argparse, a
study spec, the demo) and passed on frozen, so no command builds a Namespace to call another.

TuneOptions: what `tune` runs (from flags, from a studies/NAME.toml spec, or both: flags given win).
EngineOptions: what picks and configures an engine (`tune` and `run` both make one)."""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from . import defaults as D
from .errors import InputError
from .plan import KV_TYPES

EngineName = str      # a name planner.engines registers (the CLI, specs and the service check it there)


@dataclass(frozen=True)
class EngineOptions:
    """What makes an engine: its name, the model file (llamacpp needs it; a preset has none), llama-bench's path
    (None: $LLAMA_BENCH, else PATH), the per-run time limit, and the CPU stand-in dry run."""
    engine: EngineName
    model: str
    llama_bench: str | None = None
    timeout_s: float = D.RUN_TIMEOUT_S
    cpu_stand_in: bool = False

    @property
    def model_path(self) -> str | None:
        return None if self.model.startswith("preset:") else self.model


@dataclass(frozen=True)
class TuneOptions:
    """Everything `tune` takes. None means "the engine's or the study's default" where the flag's help says so
    (dialect: the binary's; ctx: max(DEFAULT_CTX, the workload); confirm and space: per engine)."""
    model: str
    engine: EngineName = D.TUNE_ENGINE
    hardware: str | None = None
    gpu: str | None = None
    trials: int = D.TUNE_TRIALS
    study: str | None = None
    storage: str | None = None
    objective: str = D.TUNE_OBJECTIVE
    n_prompt: int = D.TUNE_WORKLOAD.n_prompt
    n_gen: int = D.TUNE_WORKLOAD.n_gen
    depth: int = D.TUNE_WORKLOAD.depth
    reps: int = D.TUNE_WORKLOAD.repetitions
    ctx: int | None = None
    dialect: str | None = None
    llama_bench: str | None = None
    margin: str = D.TUNE_MARGIN
    cpu_stand_in: bool = False
    confirm: int | None = None
    space: str | None = None
    kv_types: tuple[str, ...] = D.TUNE_KV_TYPES
    space_limits: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)   # SpaceConfig fields (specs)
    seed: int = D.TUNE_SEED
    pool: int = D.TUNE_POOL
    timeout_s: float | None = None
    fresh: bool = False
    out: str | None = None
    no_report: bool = False
    quiet: bool = False
    json: bool = False
    spec: str | None = None        # the study spec these came from, if any (its folder holds the database)

    def engine_options(self) -> EngineOptions:
        return EngineOptions(engine=self.engine, model=self.model, llama_bench=self.llama_bench,
                             timeout_s=self.timeout_s if self.timeout_s is not None else D.RUN_TIMEOUT_S,
                             cpu_stand_in=self.cpu_stand_in)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TuneOptions:
        """From `tune`'s parsed flags (every default None or False, so a flag counts only when given), over the
        spec's values when --spec names one."""
        from .studyspec import check_model_file, load_spec
        base: dict[str, Any] = load_spec(args.spec) if getattr(args, "spec", None) else {}
        given = {f.name: v for f in fields(cls)      # `is`: a flag given as 0 (--pool 0) counts, False does not
                 if (v := getattr(args, f.name, None)) is not None and v is not False}
        if "model" in base and "model" not in given:
            check_model_file(args.spec, base["model"])
        if "kv_types" in given:
            given["kv_types"] = parse_kv_types(given["kv_types"], "--kv-types")
        if "timeout" in vars(args) and args.timeout is not None:
            given["timeout_s"] = args.timeout
        merged = {**base, **given}
        if not merged.get("model"):
            raise InputError("say which model: tune MODEL ..., or tune --spec studies/NAME.toml with model = ...")
        return cls(**merged)


def parse_kv_types(text: str, where: str) -> tuple[str, ...]:
    """'f16,q8_0' -> ("f16", "q8_0"); InputError naming `where` for an empty list or an unknown type."""
    kv = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kv or any(k not in KV_TYPES for k in kv):
        raise InputError(f"{where} {text!r}: expected a comma list of {', '.join(KV_TYPES)}")
    return kv
