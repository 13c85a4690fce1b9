"""The cost model against measured llama-bench runs: read a runs JSONL, predict each run, score the predictions.

A runs file has one JSON object a line (what benchmarks/llamacpp_gpu.py's studies record; see
tests/planner/data/h100_llamacpp_runs.md): `llama_bench_args` (the arguments after `-m MODEL`), `env` (e.g.
GGML_OP_OFFLOAD_MIN_BATCH), `pp_tps`, `tg_tps`, `peak_vram_mib`. Each run becomes a Plan through the same
parser `explain` uses, is predicted with planner.cost for a HardwareProfile, and is scored by the mean absolute
percentage error (MAPE) of TG and PP, its worst cases, and whether op offload on vs off ranks right between
runs that differ only in it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Iterable

from planner.cost import LLAMACPP, EngineFacts, predict
from planner.errors import InputError
from planner.flags import parse
from planner.flags.cmdline import RenderedCommand
from planner.hardware import HardwareProfile
from planner.model import ModelInventory
from planner.plan import Plan

SYNTHETIC_PRESET = "Qwen3-30B-A3B:Q8_0"     # shape of benchmarks/llamacpp_gpu.py's model, written all Q4_0
SYNTHETIC_QUANT = "Q4_0"


def synthetic_inventory() -> ModelInventory:
    """The model of the H100 runs without its 16 GiB file: benchmarks/llamacpp_gpu.py's synthetic
    Qwen3-30B-A3B-shaped file, every matrix Q4_0 (runtime.synth.uniform_recipe)."""
    from planner.archs import build_inventory
    from planner.presets import load_preset
    from .synth import uniform_recipe
    spec = load_preset(SYNTHETIC_PRESET).spec
    name = f"synthetic-{SYNTHETIC_PRESET.split(':')[0]}-{SYNTHETIC_QUANT}"
    return build_inventory(spec, uniform_recipe(SYNTHETIC_QUANT), name=name, source=f"{name}.gguf")


@dataclass(frozen=True)
class Run:
    index: int                  # line number in the file, from 0
    args: tuple[str, ...]       # llama-bench arguments after -m MODEL
    env: dict[str, str]
    pp_tps: float
    tg_tps: float
    peak_vram_mib: float | None
    plan: Plan
    n_prompt: int
    n_gen: int
    depth: int

    @property
    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (env + " " if env else "") + " ".join(self.args)

    @property
    def key_without_offload(self) -> tuple:
        """The run's config with op offload and the load mode left out: runs with the same key differ only in
        whether ops on host weights go to the GPU (mmap only decides how fast they upload, so it goes too)."""
        out, skip = [], False
        for a in self.args:
            if skip:
                skip = False
                continue
            if a in ("-nopo", "--no-op-offload", "-lm", "--load-mode"):
                skip = True
                continue
            out.append(a)
        return tuple(out), tuple(sorted(self.env.items()))


def restamped(hw: HardwareProfile) -> HardwareProfile:
    """hw with the committed llama.cpp shares: calibrate writes LLAMACPP_SHARES into each profile it measures, so
    a profile measured before a refit carries the old ones."""
    from planner.hardware import LLAMACPP_SHARES
    return replace(hw, overheads=replace(hw.overheads, **LLAMACPP_SHARES),
                   source=f"{hw.source}; shares restamped (LLAMACPP_SHARES)")


def run_line(bench_command: str, pp_tps: float, tg_tps: float, peak_vram_mib: int, **where: Any) -> dict[str, Any]:
    """One line of a runs file from a rendered llama-bench shell line (`VAR=value ... llama-bench -m MODEL ARGS`):
    its environment, the arguments without -m MODEL, the speeds and peak; `where` (study, trial, plan) first."""
    import shlex
    words = shlex.split(bench_command)
    i = next(k for k, w in enumerate(words) if "=" not in w)     # VAR=value ... llama-bench args
    env = dict(w.split("=", 1) for w in words[:i])
    args = words[i + 1:]
    if "-m" in args:
        del args[args.index("-m"):args.index("-m") + 2]
    return {**where, "env": env, "llama_bench_args": args, "pp_tps": pp_tps, "tg_tps": tg_tps,
            "peak_vram_mib": peak_vram_mib}


def read_runs(path: str | Path, inv: ModelInventory) -> list[Run]:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InputError(f"cannot read runs file {path}: {e.strerror}") from e
    runs = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            args = [str(a) for a in r["llama_bench_args"]]
            env = {str(k): str(v) for k, v in (r.get("env") or {}).items()}
            pp, tg = float(r.get("pp_tps") or 0.0), float(r.get("tg_tps") or 0.0)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, RecursionError) as e:
            raise InputError(f"{path}:{i + 1}: not a run (llama_bench_args, env, pp_tps, tg_tps): {e}") from e
        pc = parse(RenderedCommand(args, env=env), inv, "mainline", tool="bench")
        w = pc.bench
        runs.append(Run(i, tuple(args), env, pp, tg, r.get("peak_vram_mib"), pc.to_plan(inv.source, f"run {i}"),
                        int(w.get("n_prompt", 512)), int(w.get("n_gen", 128)), int(w.get("n_depth", 0))))
    return runs


@dataclass(frozen=True)
class Scored:
    run: Run
    pred_pp_tps: float
    pred_tg_tps: float
    breakdown: dict[str, float]

    @property
    def err_pp(self) -> float:
        return self.pred_pp_tps / self.run.pp_tps - 1 if self.run.pp_tps > 0 else float("nan")

    @property
    def err_tg(self) -> float:
        return self.pred_tg_tps / self.run.tg_tps - 1 if self.run.tg_tps > 0 else float("nan")


def score(runs: Iterable[Run], inv: ModelInventory, hw: HardwareProfile, facts: EngineFacts = LLAMACPP) -> list[Scored]:
    out = []
    for r in runs:
        p = predict(inv, r.plan, hw, n_prompt=max(r.n_prompt, 1), depth=r.depth, facts=facts)
        out.append(Scored(r, p.pp_tps, p.tg_tps, p.breakdown))
    return out


def mape(scored: Iterable[Scored]) -> dict[str, float]:
    """Mean |predicted / measured - 1| of TG and PP over the runs that measured each (as fractions)."""
    s = list(scored)
    tg = [abs(x.err_tg) for x in s if x.run.tg_tps > 0]
    pp = [abs(x.err_pp) for x in s if x.run.pp_tps > 0]
    return {"tg": sum(tg) / len(tg) if tg else float("nan"), "pp": sum(pp) / len(pp) if pp else float("nan"),
            "n": len(s)}


def offload_pairs(scored: Iterable[Scored]) -> list[dict[str, Any]]:
    """Every pair of runs equal but for op offload (and the load mode): measured and predicted PP of each side,
    and whether the prediction ranks them as the measurement does."""
    groups: dict[tuple, list[Scored]] = {}
    for s in scored:
        groups.setdefault(s.run.key_without_offload, []).append(s)
    pairs = []
    for g in groups.values():
        on = [s for s in g if s.run.plan.knobs.offload.any_enabled]
        off = [s for s in g if not s.run.plan.knobs.offload.any_enabled]
        for a in on:
            for b in off:
                pairs.append({"on": a.run.index, "off": b.run.index, "measured_pp": [a.run.pp_tps, b.run.pp_tps],
                              "predicted_pp": [a.pred_pp_tps, b.pred_pp_tps],
                              "right": (a.run.pp_tps > b.run.pp_tps) == (a.pred_pp_tps > b.pred_pp_tps)})
    return pairs


def toggled_offload(run: Run) -> Plan:
    """The run's plan with op offload switched the other way (for rankings without a measured partner)."""
    k = run.plan.knobs
    enabled = not k.offload.any_enabled
    rule = replace(k.offload.dense_matmul, enabled=enabled)
    off = replace(k.offload, dense_matmul=rule, moe_matmul=replace(k.offload.moe_matmul, enabled=enabled),
                  moe_fused_up_gate=replace(k.offload.moe_fused_up_gate, enabled=enabled),
                  output=replace(k.offload.output, enabled=enabled))
    return replace(run.plan, knobs=replace(k, offload=off))


def split_train_test(runs: list[Run]) -> tuple[list[Run], list[Run]]:
    """The split the engine constants were fitted on: even lines train, odd lines are held out."""
    return [r for r in runs if r.index % 2 == 0], [r for r in runs if r.index % 2 == 1]
