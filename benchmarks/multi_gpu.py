"""Two GPUs (issue 15): layer splits (-ts), experts per device (-ot ...=CUDA1), -ncmoe with -ts and the planner's own
two-GPU plans, measured with the mainline CUDA llama-bench on the synthetic Qwen3-30B-A3B-shaped Q4_0 model of
benchmarks/llamacpp_gpu.py (17 GB), and the same placements with the bundled torch runtime, on a machine with two
GPUs (nvidia-h200-x2).

Steps (--steps, in this order):
- memory: >= 10 two-GPU plans (make_cases). Per GPU the peak VRAM that planner.memory predicts (HardwareProfile
  "gpu-box" with two GPUs, the CUDA context included; pipeline parallelism where llama.cpp turns it on) against
  the peak sampled on that GPU during the run (NVML / nvidia-smi, per device, CUDA_DEVICE_ORDER=PCI_BUS_ID), the
  |error| against the goal max(3%, 256 MiB) on each GPU, and llama.cpp's own -v buffers per device. One run each
  (-p 2048 -n 32 -r 1: the peak is what is measured here).
- torch: the same placements (make_cases: layer splits, experts on the other GPU, experts in RAM with and without
  op offload, the output layer on the second GPU, the planner's own plans at 2x4 and 2x8 GiB; 14 plans) run by the
  torch engine (runtime/torch_engine) on cuda:0 / cuda:1, on a model it synthesizes in memory: the Qwen3-30B-A3B
  shape in BF16 cut to its first --torch-layers 16 blocks (19.7 GiB; ~10 GiB per GPU, the llama.cpp model's share
  per GPU; the same tensors per layer, so the staging buffers, KV rows and logits are the full model's). Per GPU
  the engine's peak (torch.cuda.max_memory_allocated + the CUDA context, as the one-GPU torch benchmarks measure)
  against the engine's own prediction (TorchEngine.predict_memory, the memory model `tune --engine torch`
  judges with; torch_study.py's hardware profile: the H100's calibrated one, whose GPU overhead is the torch
  engine's CUDA context; planner.memory's llama.cpp estimate kept in the JSON), the |error| against the same
  goal, and both sides' parts (engine: weights, KV, staging, activations, context; predicted: weights, KV,
  compute = staging + activations, overhead) and the GPU's own peak (NVML) beside them. Context: the workload rounded up
  to 256 cells, what the engine allocates. One run each, the memory step's workload. In a child process when
  tune follows (its CUDA context and cached weights must not stay on the GPUs that --fit and the budget cells
  read); the step alone needs no llama.cpp build or model. Why 16 layers: the first run of a process pays
  torch.compile, Triton autotuning and graph capture (~1 min), then every plan synthesizes what moved (GPU
  buffers at device speed; experts in RAM at ~1 GB/s with page-locking, measured on the H100 box) and runs a
  2048-token prompt that is upload-bound with experts in RAM (16 layers: ~0.4 s a ubatch); the whole 48 layers
  would triple the RAM plans' time (the H100 torch study: 21-27 s a plan, 136 s the first).
- tune: per budget per GPU (default 8 and 16 GiB, i.e. 2x8 and 2x16 GiB), benchmarks/tune_vs_fit.py's run_cell
  with two GPUs of that size: llama.cpp's own --fit (llama-bench -fitt, both GPUs), its placement in a server,
  the best hand `-ngl 99 -ncmoe N -ts a,b` (tuner.baselines.ncmoe_split: the smallest N with a -ts that
  fits both GPUs, the -ts that leaves the most room on the fuller one), and an Optuna study of at most --runs
  engine runs in all; the confirmation re-measures --fit, its server placement, the -ncmoe -ts line and the
  study's picks interleaved (--confirm rounds), started only when it can end in the same device call. Studies
  "mg-<B>g-d0" in <workdir>/multi_gpu.db.
- report: NAME.md and NAME.json (--name, default multi_gpu) in --out: the memory table per plan and GPU (name,
  flags, predicted and measured MiB per device, error, within goal), the torch runtime's table (JSON "torch",
  "torch_summary") and per budget cell fit / best_tg / balanced /
  ncmoe_ts, each with TG, PP (confirmed medians and spreads), VRAM per device, flags, and the ratios to --fit.
  Rewritten after every plan and every cell, so a call cut off still returns one.

A script of its own rather than `--gpus 2` in llamacpp_gpu.py and tune_vs_fit.py: the two-GPU table has a column
group per device and its own plans, the one-GPU scripts' report formats stay as their stored reports (and the
tests that read them) have them, and a device call needs one command and one state folder. It reuses their
pieces: llamacpp_gpu's model writer, goal, -v log reading and engine set-up; tune_vs_fit's run_cell (which takes
n_gpus) and cell_row.

State (kept between calls, and carried to a fresh machine): <workdir> = benchmarks/results/multi_gpu: results/
(one JSON per memory plan, plan-NAME.json, and per torch plan, torch-NAME.json), multi_gpu.db (the studies). The
model and the CUDA build live in llamacpp_gpu's workdir (benchmarks/results/llamacpp_gpu, not carried: built /
written again on a fresh machine). Every call also writes NAME_state.tar.gz (that state, well under 1 MB of JSON
plus the SQLite file) beside the report, so that a call on a fresh machine goes on where the last one stopped.
Exit 3 while work is left, 0 when every step asked for is done, 2 on bad input. The --cpu dry run keeps its
state in benchmarks/results/multi_gpu_cpu (never carried).

Device calls (nvidia-h200-x2). Here first, in the repo root: `bash benchmarks/llamacpp_gpu.sh pack` (the slim
llama.cpp source, build/llama.cpp-src.tar.gz), a .whl folder with optuna and its needs (alembic, colorlog, mako,
sqlalchemy, greenlet: the device README says how to download them), and `mkdir -p benchmarks/results/multi_gpu`
(a carried path missing here is removed there). Every call the same, timeout_s 600, carry [".whl",
"build/llama.cpp-src.tar.gz", "benchmarks/results/multi_gpu"]:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 && \
    bash benchmarks/llamacpp_gpu.sh build build/llama.cpp-src.tar.gz && \
    python3 benchmarks/multi_gpu.py --name multi_gpu_h200x2 --time-budget $((560 - SECONDS))
(the build is skipped once its binaries exist; the budget is what the build left of 560 s). After each call,
here: `tar -xzf FILES_AT/multi_gpu_h200x2_state.tar.gz -C benchmarks/results/multi_gpu`, so the next call carries
the state (on a machine still warm it is what is there already). Repeat while it exits 3; at 0 copy
FILES_AT/multi_gpu_h200x2.{md,json} to benchmarks/reported/.
Time, estimated from the H100 runs (a llama-bench run of this model ~19 s, most of it loading): the build ~5 min
(6 on 16 cores) and the model ~2-3 min, once per machine; memory 13 plans x ~10 s (-r 1) ~2-3 min; torch 14 plans
~3-4 min (the child's start and first plan ~1.5 min, the GPU-only plans ~5 s each, the RAM ones 10-30 s: ~26 GB
of experts synthesized in RAM over the step; it starts no plan without --torch-first-s 120 s left, or 1.5x its
longest plan after the first); a budget cell <= 24 runs (~5 baselines incl. --fit, ~9 search, 2 rounds x 4-5
contenders) ~8 min, its confirmation ~3-4 min started only when it fits the call. So 4 calls of ~9.5 min: (1)
build, model, most memory plans; (2) the rest of them, the torch step, the 2x8 GiB cell started; (3) its rest and
confirmation, the 2x16 GiB cell started; (4) its rest and confirmation. ~36 min of device time with the machine's
start, over the ~30 min there is. To fit: --runs 20 (~1.5 min less a cell), --budgets 8 first if only one cell
can be afforded (--confirm 2 is the least that gives a spread); or the torch step on its own later
(--steps memory,tune,report now; then the call's command without its build line and with --steps torch,report:
no build, no model, one call of ~5 min on a fresh machine).
Here, without a GPU, the whole pipeline on the CPU build and tiny models (every llama.cpp plan measured all-CPU,
the predictions still the two-GPU ones; the torch plans on two logical GPUs, the engine's CPU stand-in, where the
accountant's peak is compared with planner.memory's prediction less its CUDA context), ~15 s on 2 cores:
    .venv/bin/python benchmarks/multi_gpu.py --cpu
and the torch step on logical GPUs at the real layer shapes (2 layers of the Qwen3-30B-A3B shape, ~1 min):
    .venv/bin/python benchmarks/multi_gpu.py --cpu --steps torch,report --torch-layers 2 --torch-budgets 1,2 \
      --n-prompt 512 --workdir /tmp/mg_torch2
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_options as opts  # noqa: E402
import llamacpp_gpu as lg  # noqa: E402
from planner.engine_contract import TimedEngine  # noqa: E402
from planner.errors import BudgetError, InputError  # noqa: E402
from planner.flags import render  # noqa: E402
from planner.flags.common import base_assignment, slot_devices  # noqa: E402
from planner.gguf_header import load_inventory  # noqa: E402
from planner.hardware import GiB, MiB, HardwareProfile, load_hardware  # noqa: E402
from planner.memory import estimate, pipeline_copies  # noqa: E402
from planner.model import ModelInventory, Tensor  # noqa: E402
from planner.plan import Knobs, OffloadPolicy, Plan, device_sort_key  # noqa: E402
from planner.engine_contract import BenchRun  # noqa: E402
from runtime.llamacpp import LlamaCppEngine, bench_memory  # noqa: E402

STEPS = ("memory", "torch", "tune", "report")
DEFAULT_WORKDIR = ROOT / "benchmarks" / "results" / "multi_gpu"
# memory and torch runs (n_prompt, n_gen, reps), the study's runs (tune_*), the study: GPU value, --cpu value
DEFAULTS: opts.Defaults = {"n_prompt": (2048, 32), "n_gen": (32, 4), "reps": (1, 1), "tune_n_prompt": (2048, 32),
                           "tune_n_gen": (64, 4), "tune_reps": (3, 1), "runs": (24, 24), "confirm": (2, 2),
                           "confirm_run_s": (25.0, 0.0)}
GPUS = ("CUDA0", "CUDA1")
DEFAULT_GPU_BYTES = 143771 * MiB          # an H200 as nvidia-smi lists it (only the report's budget column uses it)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class BadInput(Exception):
    """Bad input: one line on stderr and exit 2."""


# ---- the plans -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    what: str
    plan: Plan


def split_assignment(inv: ModelInventory, counts: tuple[int, ...],
                     experts: Callable[[Tensor, str], str] | None = None,
                     gpus: tuple[str, ...] = GPUS) -> dict[str, str]:
    """-ngl 99 -ts a,b as layer counts (slots 0..a-1 on CUDA0, the rest and the output layer on CUDA1; likewise
    over more `gpus`), then each routed expert where `experts(tensor, its home)` says (default: its home)."""
    slots = slot_devices(inv.hparams.n_layer, inv.hparams.n_layer + 1, "last_slots", list(gpus), counts)
    a = base_assignment(inv, slots)
    if experts is not None:
        for t in inv.allocated():
            if t.is_expert:
                a[t.name] = experts(t, a[t.name])
    return a


def ts_counts(inv: ModelInventory, share0: float) -> tuple[int, int]:
    """Layer counts (CUDA0, CUDA1) of the n_layer + 1 slots for a share of them on CUDA0 (what -ts x,y does)."""
    slots = inv.hparams.n_layer + 1
    a = min(max(math.floor(share0 * slots + 0.5), 1), slots - 1)
    return a, slots - a


def make_cases(inv: ModelInventory, hw: HardwareProfile, budgets: list[int], n_prompt: int,
               n_ctx: int | None = None) -> list[Case]:
    """The two-GPU plans of the memory table (>= 10), the planner's own best TG plan at each budget per GPU last
    (context n_ctx, default n_prompt)."""
    moe = inv.moe_layers()
    n = len(moe)
    k40 = max(1, round(0.4 * n))
    first_third, last_two = set(moe[: n // 3]), set(moe[n // 3:])
    first_half = set(moe[: n // 2])
    ncm = max(1, n // 3)
    base = Knobs(n_ctx=n_ctx or n_prompt, n_batch=2048, n_ubatch=512)
    ub2048 = replace(base, n_batch=max(2048, n_prompt), n_ubatch=2048)
    nopo = OffloadPolicy.all(False)
    even, three_one, one_three = ts_counts(inv, 0.5), ts_counts(inv, 0.75), ts_counts(inv, 0.25)
    # the -ncmoe split a user balances by hand: CUDA0 holds the layers whose experts -ncmoe keeps in RAM
    ncm_share = min(0.5 + 0.5 * ncm / (inv.hparams.n_layer + 1), 0.8)
    ncm_counts = ts_counts(inv, ncm_share)
    blocks_on_0 = (inv.hparams.n_layer, 1)                   # every block on CUDA0, the output layer on CUDA1

    def ram_if(pred: Callable[[Tensor], bool]) -> Callable[[Tensor, str], str]:
        return lambda t, home: "CPU" if pred(t) else home

    def crossed(t: Tensor, home: str) -> str:
        return "CUDA1" if home == "CUDA0" else "CUDA0"

    def attn0_exps1(t: Tensor, home: str) -> str:
        return "CPU" if t.layer in first_third else "CUDA1"

    def ncmoe(t: Tensor, home: str) -> str:        # mainline -ncmoe N: the experts of the first N layers in RAM
        return "CPU" if t.layer is not None and t.layer < ncm else home

    def plan(a: dict[str, str], knobs: Knobs = base) -> Plan:
        return Plan("m", a, knobs)

    cases = [
        Case("ts-1-1", f"every tensor on the GPUs, -ts 1,1 ({even[0]}/{even[1]} slots; pipeline parallel)",
             plan(split_assignment(inv, even))),
        Case("ts-3-1", f"every tensor on the GPUs, -ts 3,1 ({three_one[0]}/{three_one[1]} slots)",
             plan(split_assignment(inv, three_one))),
        Case("ts-1-3", f"every tensor on the GPUs, -ts 1,3 ({one_three[0]}/{one_three[1]} slots)",
             plan(split_assignment(inv, one_three))),
        Case("ts-1-1-ub2048", "as ts-1-1, -ub 2048 -b 2048 (pipeline parallelism's input copies x4 at 2048 tokens)",
             plan(split_assignment(inv, even), ub2048)),
        Case(f"ts-1-1-exps-last{k40}", f"-ts 1,1, the experts of the last {k40} MoE layers (on CUDA1) in RAM",
             plan(split_assignment(inv, even, ram_if(lambda t: t.layer in set(moe[-k40:]))))),
        Case(f"ncmoe{ncm}-ts-1-1", f"-ncmoe {ncm} -ts 1,1: the experts of the first {ncm} layers (all on CUDA0) in RAM",
             plan(split_assignment(inv, even, ncmoe))),
        Case(f"ncmoe{ncm}-ts-{ncm_counts[0]}-{ncm_counts[1]}",
             f"-ncmoe {ncm} with the split moved towards CUDA0 ({ncm_counts[0]}/{ncm_counts[1]} slots) to even out "
             "the GPUs", plan(split_assignment(inv, ncm_counts, ncmoe))),
        Case("exps-crossed", "-ts 1,1 homes, every expert on the other GPU (-ot ...=CUDA1 for the first half's "
             "experts, =CUDA0 for the second's): activations cross the GPUs twice per layer",
             plan(split_assignment(inv, even, crossed))),
        Case("attn0-exps1-out1", f"every block homed on CUDA0, the output layer on CUDA1 (-ts {blocks_on_0[0]},1), "
             f"the experts of the first {len(first_third)} layers in RAM and of the other {len(last_two)} on CUDA1",
             plan(split_assignment(inv, blocks_on_0, attn0_exps1))),
        Case("cmoe-ts-1-1", "-ts 1,1, every expert in RAM (-cmoe), op offload on (the prompt's experts run on CUDA0)",
             plan(split_assignment(inv, even, ram_if(lambda t: True)))),
        Case("cmoe-ts-1-1-nopo", "as cmoe-ts-1-1, op offload off (-nopo 1)",
             plan(split_assignment(inv, even, ram_if(lambda t: True)), replace(base, offload=nopo))),
        Case("half-exps-ram-ts-1-1-ub2048", f"-ts 1,1, the experts of the first {len(first_half)} layers in RAM, "
             "-ub 2048: op offload's expert uploads to CUDA0 at 2048 tokens",
             plan(split_assignment(inv, even, ram_if(lambda t: t.layer in first_half)), ub2048)),
    ]
    from planner.propose import best_plans
    for b in budgets:
        try:
            best = best_plans(inv, hw.with_vram([b * GiB, b * GiB]), base, "mainline", "tg", lg.GOAL_FLOOR,
                              n_prompt)[0]
        except BudgetError as e:
            log(f"memory: no planner plan at 2x{b} GiB: {e}")
            continue
        cases.append(Case(f"planner-2x{b}G", f"offload-tuner plan's best TG plan for 2x{b} GiB ({best.plan.label})",
                          best.plan))
    return [replace(c, plan=replace(c.plan, model_id=inv.source, label=c.name)) for c in cases]


def placement_flags(argv: list[str]) -> str:
    """The flags of a rendered llama-bench line that say where things go and how it runs (-m/-p/-n/-r/-o left out)."""
    out, skip = [], {"-m", "-p", "-n", "-r", "-o", "-d"}
    it = iter(argv)
    for a in it:
        if a in skip:
            next(it, None)
            continue
        out.append(a)
    return " ".join(out)


# ---- measuring -------------------------------------------------------------------------------------------------------

def device_row(predicted: dict[str, Any], measured: int | None, logged: dict[str, int] | None) -> dict[str, Any]:
    row = lg.compare(predicted, measured)
    row.update({f"{k}_mib": None if row[f"{k}_bytes"] is None else round(row[f"{k}_bytes"] / MiB, 1)
                for k in ("predicted", "measured", "error", "goal")})
    row["predicted_parts"] = {k: predicted.get(k, 0) for k in ("weights", "kv", "compute", "overhead")}
    row["log"] = logged
    return row


def measure_case(engine: LlamaCppEngine, inv: ModelInventory, case: Case, wl: BenchRun, hw: HardwareProfile,
                 cpu: bool, gpus: tuple[str, ...] = GPUS) -> dict[str, Any]:
    run_plan = lg.cpu_variant(case.plan) if cpu else case.plan
    rc = render(case.plan, inv, "bench", bench=wl, model_path=str(inv.source))
    pred = bench_memory(inv, case.plan, wl, hw).to_dict()["devices"]
    t0 = time.monotonic()
    m = engine.measure(inv, run_plan, wl)
    devices = {}
    for d in gpus:
        measured = None if cpu else m.peak_bytes.get(d)
        devices[d] = device_row(pred.get(d, {"total": 0}), measured, lg.log_device(m.raw, d))
    checked = [r["within_goal"] for r in devices.values() if r["within_goal"] is not None]
    lm = m.raw.get("log_memory") or {}
    return {
        "name": case.name, "what": case.what, "plan_id": case.plan.id, "plan": case.plan.to_dict(),
        "knobs": {"n_ubatch": case.plan.knobs.n_ubatch, "n_batch": case.plan.knobs.n_batch,
                  "op_offload": case.plan.knobs.offload.any_enabled},
        "flags": placement_flags(list(rc)), "command": rc.shell(str(engine.path)), "ran": m.raw.get("command"),
        "cpu_mode": cpu, "seconds": round(time.monotonic() - t0, 1), "measurement": m.to_dict(),
        "predicted": pred, "predicted_devices": sorted((d for d in pred if d != "CPU"), key=device_sort_key),
        "pipeline_copies": pipeline_copies(inv, case.plan), "pipeline_parallel_logged": lm.get("pipeline_parallel"),
        "devices": devices, "within_goal": (all(checked) if checked else None),
    }


def log_result(step: str, name: str, rec: dict[str, Any]) -> None:
    """One line per measured plan: speeds, and measured against predicted per device."""
    m = rec["measurement"]
    per = "; ".join(f"{d} measured {lg._mib(r['measured_bytes'])} predicted {lg._mib(r['predicted_bytes'])} MiB"
                    for d, r in rec["devices"].items())
    log(f"{step}: {name}: {'ok' if m['ok'] else 'FAILED ' + m['error']}; PP {m['pp_tps']:.1f} TG "
        f"{m['tg_tps']:.2f} t/s; {per} ({rec['seconds']} s)")


def run_memory(args, engine: LlamaCppEngine, inv: ModelInventory, hw: HardwareProfile, cases: list[Case],
               wl: BenchRun, results_dir: Path, t_start: float, after_each: Callable[[], None]) -> bool:
    """Measure the plans not measured yet; False when the time budget stopped it early."""
    results_dir.mkdir(parents=True, exist_ok=True)
    wanted = [c for c in cases if not args.plans or c.name in args.plans]
    for i, case in enumerate(wanted):
        out = results_dir / f"plan-{case.name}.json"
        if out.exists() and not args.redo:
            continue
        left = lg.time_left(args, t_start)
        if left < args.min_left:
            log(f"memory: stopping, {left:.0f} s left of --time-budget; run again to continue")
            return False
        log(f"memory: [{i + 1}/{len(wanted)}] {case.name}: {case.what}")
        rec = measure_case(engine, inv, case, wl, hw, args.cpu)
        log_result("memory", case.name, rec)
        lg.write_json(out, rec)
        after_each()
    log(f"memory: all {len(wanted)} plans done")
    return True


# ---- the torch runtime's two-device placements -----------------------------------------------------------------------

TORCH_PRESET = "Qwen3-30B-A3B:BF16"
TORCH_LAYERS = 16
TORCH_HARDWARE = ROOT / "benchmarks" / "reported" / "runtime_roofline_h100_hw.json"
TORCH_FIRST_RUN_S = 120.0        # the first plan of a process: torch.compile, Triton autotuning, CUDA graph capture
TORCH_BUDGETS = (4, 8)           # GiB per GPU of the planner's own plans of the 16-layer model (19.7 GiB)


def torch_inventory(n_layer: int) -> ModelInventory:
    """The torch step's model, its weights synthesized in memory by the engine (no file): Qwen3-30B-A3B's shape in
    BF16 cut to its first n_layer blocks; n_layer 0: the --cpu dry run's tiny qwen3moe (lg.write_model's shape)
    in BF16."""
    from planner.archs import build_inventory
    if n_layer <= 0:
        from runtime.synth import tiny_spec, uniform_recipe
        return build_inventory(tiny_spec("qwen3moe", n_layer=8, n_expert=16, n_expert_used=4), uniform_recipe("BF16"),
                               name="tiny-qwen3moe BF16", source="synthetic:tiny-qwen3moe-bf16")
    from planner.presets import load_preset
    p = load_preset(TORCH_PRESET)
    hp = p.spec.hparams
    if n_layer > hp.n_layer:
        raise BadInput(f"--torch-layers {n_layer}: {p.name} has {hp.n_layer} layers")
    cut = replace(hp, n_layer=n_layer, n_head_kv=hp.n_head_kv[:n_layer], moe_layers=hp.moe_layers[:n_layer],
                  swa_layers=hp.swa_layers[:n_layer])
    return build_inventory(replace(p.spec, hparams=cut), p.type_of, tied_output=p.tied_output,
                           name=f"{p.name} BF16, {n_layer} of {hp.n_layer} layers",
                           source=f"synthetic:{p.key}-bf16-{n_layer}l")


def torch_hardware(path: str | Path, gpu_bytes: int = DEFAULT_GPU_BYTES) -> HardwareProfile:
    """What the one-GPU torch benchmarks predict with (torch_study.py's --hardware: the H100's calibrated profile,
    the torch engine's CUDA context as its GPU overhead), with two GPUs of gpu_bytes."""
    return load_hardware(str(path)).with_vram([gpu_bytes] * len(GPUS))


def _torch_rank(name: str) -> int:
    """Where a plan runs in the torch step: the GPU-only ones first, then those with experts in RAM in an order
    where each keeps most of the last one's host buffers (the engine keeps a weight where the next plan wants it,
    and synthesizes and page-locks only what moved: ~1 s per GB in RAM on the H100 box)."""
    order = (("ts-",), ("exps-crossed",), ("ncmoe",), ("attn0-",), ("half-exps-ram",), ("cmoe-ts-1-1",),
             ("cmoe-ts-1-1-nopo",), ("ts-1-1-exps-last",), ("planner-",))
    rank = len(order)
    for i, prefixes in enumerate(order):
        if name.startswith(prefixes) and not (prefixes == ("ts-",) and "exps" in name):
            rank = i
    return rank


def torch_cases(inv: ModelInventory, hw: HardwareProfile, budgets: list[int], wl: BenchRun) -> list[Case]:
    """The memory table's two-GPU plans (make_cases) for the torch step's model, with a context of the workload
    rounded up to 256 cells (the KV cache the engine allocates for it and the one planner.memory counts agree),
    in the order _torch_rank gives."""
    n_ctx = -(-(wl.depth + wl.n_prompt + wl.n_gen) // 256) * 256
    return sorted(make_cases(inv, hw, budgets, wl.n_prompt, n_ctx=n_ctx), key=lambda c: _torch_rank(c.name))


def torch_device_row(pred: dict[str, Any], peak: int | None, logical: bool, parts: dict[str, int],
                     context: int, device_peak: int | None) -> dict[str, Any]:
    """One GPU of a torch run: planner.memory's total (on a logical GPU without the CUDA context it counts: there
    is none) against the engine's peak, the goal, and both sides' parts."""
    compared = dict(pred)
    if logical:
        compared["total"] = pred.get("total", 0) - pred.get("overhead", 0)
    row = device_row(compared, peak, None)
    row.pop("log")
    row["predicted_with_context_bytes"] = pred.get("total", 0)
    row["context_excluded"] = logical
    w, kv, st = (int(parts.get(k, 0)) for k in ("weights", "kv", "staging"))
    row["engine_parts"] = {"weights": w, "kv": kv, "staging": st, "context": context,
                           "activations": None if peak is None else peak - w - kv - st - context}
    row["device_peak_bytes"] = device_peak
    row["device_peak_mib"] = None if device_peak is None else round(device_peak / MiB, 1)
    return row


def measure_torch_case(engine: Any, inv: ModelInventory, case: Case, wl: BenchRun, hw: HardwareProfile,
                       logical: bool, sampler: Any, baseline: dict[int, int], index: int) -> dict[str, Any]:
    from runtime import gpumem
    # the engine's own memory model (its dry-run accountant: TorchEngine.predict_memory), and planner.memory's
    # (llama.cpp's memory, what the torch step predicted with before) beside it
    pred = engine.predict_memory(inv, case.plan, hw, wl).to_dict()["devices"]
    pred_llamacpp = estimate(inv, case.plan, hw).to_dict()["devices"]
    rc = render(case.plan, inv, "bench", bench=wl, model_path="MODEL.gguf")
    t0 = time.monotonic()
    if sampler is not None:
        sampler.start()
    try:
        m = engine.measure(inv, case.plan, wl)
    finally:
        smi_peak = sampler.stop()[0] if sampler is not None else {}
    device_peak = gpumem.per_cuda_device({i: b - baseline.get(i, 0) for i, b in smi_peak.items()})
    parts = m.raw.get("static_parts") or {}
    context = m.raw.get("context_bytes") or {}
    devices = {}
    for d in GPUS:
        measured = int(m.peak_bytes[d]) if m.ok and d in m.peak_bytes else None
        devices[d] = torch_device_row(pred.get(d, {"total": 0}), measured, logical, parts.get(d, {}),
                                      int(context.get(d, 0)), device_peak.get(d))
    checked = [r["within_goal"] for r in devices.values() if r["within_goal"] is not None]
    return {
        "name": case.name, "what": case.what, "index": index, "plan_id": case.plan.id, "plan": case.plan.to_dict(),
        "knobs": {"n_ubatch": case.plan.knobs.n_ubatch, "n_batch": case.plan.knobs.n_batch,
                  "n_ctx": case.plan.knobs.n_ctx, "op_offload": case.plan.knobs.offload.any_enabled},
        "flags": placement_flags(list(rc)), "logical_gpus": logical, "seconds": round(time.monotonic() - t0, 1),
        "workload": {"n_prompt": wl.n_prompt, "n_gen": wl.n_gen, "repetitions": wl.repetitions},
        "model": inv.name, "model_gib": round(inv.total_bytes() / GiB, 2), "hardware": hw.name,
        "engine": torch_engine_info(engine, logical), "measurement": m.to_dict(), "predicted": pred,
        "memory_model": "torch engine (TorchEngine.predict_memory)", "predicted_planner_memory": pred_llamacpp,
        "predicted_devices": sorted((d for d in pred if d != "CPU"), key=device_sort_key),
        "devices": devices, "within_goal": (all(checked) if checked else None),
    }


def torch_engine_info(engine: Any, logical: bool) -> dict[str, Any]:
    import torch
    info = {"torch": torch.__version__, "compute_dtype": engine.compute_dtype, "weights": engine.weights,
            "device_map": engine.device_map if isinstance(engine.device_map, (str, dict)) else None,
            "compile": engine.compile, "cuda_graphs": engine.use_cuda_graphs, "logical_gpus": logical}
    if not logical:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(len(GPUS))]
    return info


def run_torch(args, results_dir: Path, t_start: float, after_each: Callable[[], None]) -> bool:
    """Measure the torch step's plans not measured yet with the torch engine on cuda:0 / cuda:1 (--cpu: two
    logical GPUs); False when the time budget stopped it early. A plan whose process died twice while measuring
    it (a crash, or a call cut off) is recorded as failed, so that the step always gets past it."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")       # CUDA<i> = NVML's GPU i (before CUDA starts)
    import torch

    from runtime import gpumem
    from planner.engine_contract import Measurement
    from runtime.torch_engine import TorchEngine
    logical = args.cpu
    if not logical and torch.cuda.device_count() < len(GPUS):
        raise BadInput(f"the torch step needs {len(GPUS)} CUDA GPUs, torch sees {torch.cuda.device_count()} "
                       "(--cpu for a dry run on logical GPUs)")
    inv = torch_inventory(args.torch_layers)
    hw = torch_hardware(args.torch_hardware)
    wl = torch_workload(args)
    cases = torch_cases(inv, hw, args.torch_budgets, wl)
    unknown = [p for p in args.torch_plans if p not in {c.name for c in cases}]
    if unknown:
        raise BadInput(f"unknown torch plan {unknown[0]!r}; --list shows them")
    wanted = [(i, c) for i, c in enumerate(cases) if not args.torch_plans or c.name in args.torch_plans]
    todo = [(i, c) for i, c in wanted if args.redo or not (results_dir / f"torch-{c.name}.json").exists()]
    if not todo:
        log(f"torch: all {len(wanted)} plans done")
        return True
    sampler = None if logical else gpumem.detect()
    baseline = sampler.used() if sampler is not None else {}       # before this process's first CUDA call
    engine = TorchEngine(device_map="logical" if logical else {g: f"cuda:{g[4:]}" for g in GPUS},
                         weights="synthetic", logical_gpu_bytes=DEFAULT_GPU_BYTES if logical else None)
    log(f"torch: {inv.name} ({inv.total_bytes() / GiB:.1f} GiB), {len(todo)} of {len(wanted)} plans to measure on "
        + ("two logical GPUs" if logical else ", ".join(f"{g}: {torch.cuda.get_device_name(i)}"
                                                          for i, g in enumerate(GPUS))))
    longest = None
    for k, (i, case) in enumerate(todo):
        need = args.torch_first_s if longest is None else max(args.min_left, 1.5 * longest)
        left = lg.time_left(args, t_start)
        if left < need:
            log(f"torch: stopping, {left:.0f} s left of --time-budget (a run needs ~{need:.0f} s); run again")
            return False
        out, marker = results_dir / f"torch-{case.name}.json", results_dir / f"torchrun-{case.name}.json"
        attempts = json.loads(marker.read_text()).get("attempts", 0) if marker.exists() else 0
        if attempts >= 2:
            log(f"torch: {case.name}: its process died twice while measuring it; recorded as failed")
            m = Measurement.failed("the process died while measuring it, twice (a crash, or calls cut off)")
            rec = {"name": case.name, "what": case.what, "index": i, "plan_id": case.plan.id,
                   "plan": case.plan.to_dict(), "flags": "", "logical_gpus": logical, "seconds": 0.0,
                   "model": inv.name, "hardware": hw.name, "measurement": m.to_dict(),
                   "predicted": engine.predict_memory(inv, case.plan, hw, wl).to_dict()["devices"],
                   "memory_model": "torch engine (TorchEngine.predict_memory)", "within_goal": None,
                   "devices": {}}
        else:
            lg.write_json(marker, {"attempts": attempts + 1})
            log(f"torch: [{k + 1}/{len(todo)}] {case.name}: {case.what}")
            rec = measure_torch_case(engine, inv, case, wl, hw, logical, sampler, baseline, i)
            longest = max(longest or 0.0, rec["seconds"]) if k else 0.0      # the first run is not typical
            log_result("torch", case.name, rec)
        lg.write_json(out, rec)
        marker.unlink(missing_ok=True)
        after_each()
    log(f"torch: all {len(wanted)} plans done")
    return True


def torch_workload(args) -> BenchRun:
    return BenchRun(args.n_prompt, args.n_gen, 0, args.reps)


def run_torch_child(args, argv: list[str], t_start: float, meta_path: Path) -> bool:
    """The torch step in a child process: its CUDA context and cached weights leave the GPUs with it, before the
    tune step's llama.cpp runs (whose --fit and budgets read the GPUs' free memory). Started again if it died
    (the plan it died in is retried once, then recorded as failed); exit 2 there (bad input) is one here."""
    for _ in range(3):
        left = lg.time_left(args, t_start)
        if left < args.min_left:
            log(f"torch: not started, {left:.0f} s left; run again")
            return False
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--steps", "torch", "--torch-in-process",
               "--time-budget", f"{left:.0f}", "--meta", str(meta_path)]
        rc = subprocess.run(cmd).returncode
        if rc in (0, 3):
            return rc == 0
        if rc == 2:
            raise BadInput("the torch step's process stopped on bad input (its message above)")
        log(f"torch: its process died (exit {rc}); starting it again")
    return False


# ---- the budget cells ------------------------------------------------------------------------------------------------

def cell_name(budget_gib: int, depth: int = 0) -> str:
    return f"mg-{budget_gib}g-d{depth}"


def run_tune(args, engine: Any, inv: ModelInventory, hw0: HardwareProfile, t_start: float,
             after_each: Callable[[], None]) -> bool:
    """Every budget cell to its confirmation; False when the time budget stopped it (the next call goes on)."""
    import tune_vs_fit as tvf
    targs = argparse.Namespace(n_prompt=args.tune_n_prompt, n_gen=args.tune_n_gen, reps=args.tune_reps,
                               runs=args.runs, confirm=args.confirm, storage=args.storage, seed=args.seed,
                               pool=args.pool, reconfirm=False)
    deadline = t_start + args.time_budget
    done = True
    for b in args.budgets:
        if _confirmed(args.storage, cell_name(b)):
            continue
        if deadline - time.monotonic() < args.cell_min_left:     # a baseline in flight is not stopped at the deadline
            log(f"{cell_name(b)}: not started, {deadline - time.monotonic():.0f} s left; run again")
            return False
        ok = tvf.run_cell(targs, engine, inv, hw0, b, 0, deadline, "mainline", cell_name(b), n_gpus=len(GPUS),
                          confirm_ncmoe=True, call_s=max(args.time_budget, tvf.WHOLE_CALL_S),
                          confirm_run_s=lambda: engine.run_seconds(args.confirm_run_s), checkpoint=after_each)
        log(f"{cell_name(b)}: {'confirmed' if ok else 'not finished: run again'}")
        after_each()
        if not ok:
            done = False
            break        # the next call goes on with this cell (its confirmation whole in one call)
    return done


def _confirmed(storage: str, name: str) -> bool:
    from tuner.records import StudyRecord
    from tuner.storage import make_storage
    st = make_storage(storage)
    for s in st.get_all_studies():
        if s.study_name == name:
            return bool(StudyRecord.of(s).confirmed)
    return False


def budget_rows(storage: str, budgets: list[int]) -> list[dict[str, Any]]:
    """One row per budget cell that has a study: tune_vs_fit's cell_row plus the two-GPU view of it."""
    import optuna

    import tune_vs_fit as tvf
    from tuner.storage import make_storage
    st = make_storage(storage)
    names = {s.study_name for s in st.get_all_studies()}
    rows = []
    for b in budgets:
        if cell_name(b) not in names:
            continue
        study = optuna.load_study(study_name=cell_name(b), storage=st)
        row = tvf.cell_row(study, b, 0)
        rows.append(two_gpu_row(row, b))
    return rows


def _ratio(a: dict[str, Any] | None, base: dict[str, Any] | None, key: str) -> float | None:
    return a[key] / base[key] if a and base and base.get(key) else None


def two_gpu_row(row: dict[str, Any], b: int) -> dict[str, Any]:
    """The cell as the issue asks for it: fit / best_tg / balanced / ncmoe_ts each with TG, PP, VRAM per device,
    flags, and the TG and PP ratios to --fit (confirmed medians; the -ncmoe -ts line's single baseline run when
    its confirmation is missing)."""
    fit = row.get("fit")
    nc = row.get("ncmoe_confirmed")
    if nc is None and (row.get("ncmoe") or {}).get("ok"):
        n0 = row["ncmoe"]
        nc = {"tg": n0["tg_tps"], "pp": n0["pp_tps"], "vram_mib": n0["vram_mib"],
              "vram_mib_by_device": n0.get("vram_mib_by_device", {}), "flags": n0.get("flags", ""),
              "name": n0["name"], "unconfirmed": True}
    elif nc is not None:
        nc = {**nc, "ts": (row.get("ncmoe") or {}).get("ts")}
    out = {"budget_gib_per_gpu": b, "budgets_gib": [b] * len(GPUS), "study": row["study"], "runs": row["runs"],
           "engine_runs": row["engine_runs"], "confirmed": row["confirmed"], "margin_mib": row.get("margin_mib"),
           "fit": fit, "fit_server": row.get("fit_server"), "best_tg": row.get("best_tg"),
           "balanced": row.get("balanced"), "ncmoe_ts": nc,
           "ncmoe_baseline": row.get("ncmoe"), "front": row.get("front"),
           "over_budget_runs": row.get("over_budget_runs")}
    out["ratios"] = {role: {"tg": _ratio(out[role], fit, "tg"), "pp": _ratio(out[role], fit, "pp"),
                            "tg_verdict": ((out[role] or {}).get("tg_vs_fit") or {}).get("verdict"),
                            "pp_verdict": ((out[role] or {}).get("pp_vs_fit") or {}).get("verdict")}
                     for role in ("best_tg", "balanced", "ncmoe_ts", "fit_server")}
    return out


# ---- report ----------------------------------------------------------------------------------------------------------

def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def _check_cells(r: dict[str, Any]) -> list[str]:
    """A GPU's measured / predicted / error / within-goal cells of a memory table row."""
    ok = "-" if r["within_goal"] is None else ("yes" if r["within_goal"] else "**no**")
    err = "-" if r["error_bytes"] is None else _mib(r["error_bytes"]) + \
        ("" if r["error_pct"] is None else f" ({r['error_pct']:+.1f}%)")
    return [_mib(r["measured_bytes"]), _mib(r["predicted_bytes"]), err, ok]


def _pred_parts(pr: dict[str, int]) -> str:
    return "+".join(_mib(pr[k]) for k in ("weights", "kv", "compute", "overhead"))


def _flags_cell(flags: str, width: int) -> str:
    flags = flags.replace("|", "\\|")
    return flags if len(flags) <= width else flags[:width - 3] + "..."


def memory_summary(plans: list[dict[str, Any]]) -> dict[str, int]:
    checked = [r for p in plans for r in p["devices"].values() if r["within_goal"] is not None]
    return {"plans": len(plans), "plans_measured": sum(1 for p in plans if p["within_goal"] is not None),
            "plans_within_goal": sum(1 for p in plans if p["within_goal"]),
            "device_checks": len(checked), "device_checks_within_goal": sum(1 for r in checked if r["within_goal"])}


def report(meta: dict[str, Any], plans: list[dict[str, Any]], rows: list[dict[str, Any]], out_dir: Path,
           name: str, torch_recs: list[dict[str, Any]] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    order = {n: i for i, n in enumerate(meta.get("case_order", []))}
    plans = sorted(plans, key=lambda p: order.get(p["name"], 1 << 30))
    torch_recs = sorted(torch_recs or [], key=lambda p: p.get("index", 1 << 30))
    checked = [(p, d, r) for p in plans for d, r in p["devices"].items() if r["within_goal"] is not None]
    summary = memory_summary(plans)
    lg.write_json(out_dir / f"{name}.json", {"meta": meta, "memory_summary": summary, "memory": plans,
                                             "torch_summary": memory_summary(torch_recs), "torch": torch_recs,
                                             "budgets": rows})
    torch_gpus = next((r["engine"].get("gpus") for r in torch_recs if r.get("engine", {}).get("gpus")), None)
    gpu = meta.get("gpu") or ("no GPU (CPU dry run)" if meta.get("cpu_mode") else
                              ", ".join(f"cuda:{i}: {g}" for i, g in enumerate(torch_gpus)) if torch_gpus else "-")
    b = meta.get("binary") or {}
    model = (f"model {Path(meta['model']).name} ({meta['model_gib']:.2f} GiB, {lg.QUANT})" if meta.get("model")
             else "llama.cpp's model: not set up in this call")
    binary = (f"binary {b['path']} ({b['dialect']}, -ngl rule {b['ngl_rule']})" if b
              else "binary: not set up in this call")
    L = [f"# Two GPUs: predicted vs measured VRAM per device, and the tuner against --fit ({gpu})", "",
         f"{meta['date']}; {model}; {binary}; VRAM "
         f"from {meta.get('vram_source')}; predictions: planner.memory with hardware '{meta['hardware']}' (two GPUs, "
         "CUDA context included), max over llama-bench's pp and tg contexts.", ""]
    if meta.get("cpu_mode"):
        L += ["**CPU dry run**: every plan ran with all tensors on the CPU; the measured VRAM columns are empty, "
              "the predictions are the two-GPU ones.", ""]
    if not plans:
        L += ["## Memory per device", "", "Not run in the calls of this report (no memory step).", ""]
    else:
        wm = meta["memory_workload"]
        L += ["## Memory per device", "",
              f"Workload -p {wm['n_prompt']} -n {wm['n_gen']} -r {wm['repetitions']}. error = predicted - measured; "
              "measured = the GPU's peak memory in use during the run minus its reading before it (CUDA context "
              "included); goal |error| <= max(3%, 256 MiB) on each GPU. log = llama.cpp's -v buffers on the device "
              "(model + KV + compute/output of the larger context); pred parts = weights + KV + compute + overhead. "
              "pp x4: pipeline parallelism predicted (llama.cpp logged it: yes/no).", "",
              "| plan | flags | PP t/s | TG t/s | pp x4 | CUDA0 measured | predicted | error | ok | CUDA1 measured | "
              "predicted | error | ok | log CUDA0 | log CUDA1 | pred parts CUDA0 | pred parts CUDA1 |",
              "|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|---:|---|---|---|---|---|"]
        for p in plans:
            m = p["measurement"]
            pp = f"{m['pp_tps']:.1f}" if m["ok"] else f"FAILED: {m['error'][:60]}"
            cells = []
            for d in GPUS:
                r = p["devices"][d]
                cells += _check_cells(r)
            logs, parts = [], []
            for d in GPUS:
                lgd = p["devices"][d]["log"]
                logs.append("-" if not lgd else f"{_mib(lgd['model'])}+{_mib(lgd['kv'])}+"
                                                f"{_mib(lgd['compute'] + lgd['output'])}")
                pr = p["devices"][d]["predicted_parts"]
                parts.append(_pred_parts(pr))
            logged = p.get("pipeline_parallel_logged")
            pipe = ("yes" if p["pipeline_copies"] > 1 else "no") + ("" if logged is None else
                                                                    f" ({'yes' if logged else 'no'})")
            flags = _flags_cell(p["flags"], 120)
            L.append(f"| {p['name']} | `{flags}` | {pp} | {m['tg_tps']:.2f} | {pipe} | " + " | ".join(cells) + " | "
                     + " | ".join(logs) + " | " + " | ".join(parts) + " |")
        over = [f"{p['name']} {d}" for p, d, r in checked if not r["within_goal"]]
        L += ["", f"{summary['device_checks_within_goal']} of {summary['device_checks']} per-GPU peaks within the goal "
              f"({summary['plans_within_goal']} of {summary['plans_measured']} plans on both GPUs)"
              + (f"; over: {', '.join(over)}" if over else "") + ".", ""]
    L += torch_section(torch_recs)
    if not rows:
        L += ["## Budgets per GPU", "", "Not run in the calls of this report (no tune step).", ""]
    else:
        L += ["## Budgets per GPU: llama.cpp's --fit, the best hand -ncmoe N -ts a,b, and the study", "",
              f"Workload -p {meta['n_prompt']} -n {meta['n_gen']} -r {meta['reps']}; at most {meta['runs']} engine "
              f"runs per cell (baselines, search, {meta['confirm']} rounds of confirmation); TG/PP are confirmed "
              "medians over runs interleaved in one device call ([min-max]); x: ratio to --fit's median, 'tie' when "
              "inside the larger spread; VRAM: the largest peak per GPU over the confirmation's runs.", "",
              "| budget | config | TG t/s | PP t/s | VRAM CUDA0 / CUDA1 MiB | TG x | PP x | flags |",
              "|---|---|---|---|---|---|---|---|"]

        def spread(p: dict[str, Any], k: str, fmt: str) -> str:
            rng = p.get(f"{k}_range")
            return f"{p[k]:{fmt}}" + (f" [{rng[0]:{fmt}}-{rng[1]:{fmt}}]" if rng else " (one run)")

        for r in sorted(rows, key=lambda r: r["budget_gib_per_gpu"]):
            b = r["budget_gib_per_gpu"]
            for role, label in (("fit", "--fit (llama-bench -fitt)"), ("fit_server", "--fit's placement in a server"),
                                ("ncmoe_ts", "best -ncmoe N -ts a,b"), ("best_tg", "study: best TG"),
                                ("balanced", "study: balanced (PP >= 1.5x --fit)")):
                p = r.get(role)
                if not p:
                    if role != "fit_server":
                        L.append(f"| 2x{b} GiB | {label} | - | - | - | - | - | - |")
                    continue
                vd = p.get("vram_mib_by_device") or {}
                vram = " / ".join(f"{vd[d]:,.0f}" if d in vd else "-" for d in GPUS)
                rat = r["ratios"].get(role) or {}
                tgx = "1" if role == "fit" else ("-" if rat.get("tg") is None else
                                                 f"{rat['tg']:.3f} {rat.get('tg_verdict') or ''}".strip())
                ppx = "1" if role == "fit" else ("-" if rat.get("pp") is None else
                                                 f"{rat['pp']:.3f} {rat.get('pp_verdict') or ''}".strip())
                flags = (p.get("flags") or "").replace("|", "\\|")
                if len(flags) > 160:
                    flags = flags[:157] + "..."
                L.append(f"| 2x{b} GiB | {label}{' (unconfirmed)' if p.get('unconfirmed') else ''} | "
                         f"{spread(p, 'tg', '.2f')} | {spread(p, 'pp', '.0f')} | {vram} | {tgx} | {ppx} | `{flags}` |")
        if rows:
            L += ["", "Runs per cell: " + "; ".join(
                f"2x{r['budget_gib_per_gpu']} GiB: {r['engine_runs']}"
                f"{'' if r['confirmed'] else ' (not confirmed yet)'}, learnt margin {r['margin_mib'] or 0:.0f} MiB"
                for r in rows), ""]
    if plot_shares([("llama.cpp (llama-bench)", plans), ("torch runtime", torch_recs)], GPUS,
                   out_dir / f"{name}.png", f"Two GPUs: each GPU's share and the prediction's error per plan ({gpu})"):
        L += [f"![memory per GPU]({name}.png)", ""]
    if meta.get("note"):
        L += [meta["note"], ""]
    (out_dir / f"{name}.md").write_text("\n".join(L) + "\n")
    log(f"report: {out_dir / name}.md and .json ({len(plans)} plans, {len(torch_recs)} torch plans, {len(rows)} "
        "budget cells)")


def plot_shares(sections: list[tuple[str, list[dict[str, Any]]]], gpus: tuple[str, ...], path: Path,
                title: str) -> bool:
    """Per section (an engine's plans) and plan: the VRAM measured on each GPU (each GPU's share of the model) and
    the prediction's error on each GPU against the goal's 256 MiB band. False when no plan was measured."""
    sections = [(label, rows) for label, rows0 in sections
                if (rows := [p for p in rows0 if p.get("within_goal") is not None])]
    if not sections:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    heights = [len(rows) + 1.2 for _, rows in sections]
    fig, axes = plt.subplots(len(sections), 2, figsize=(13, 0.42 * sum(heights) + 1.0), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    height = 0.8 / len(gpus)
    for (label, rows), (ax_mib, ax_err) in zip(sections, axes):
        for k, d in enumerate(gpus):
            ys = [i + (k - (len(gpus) - 1) / 2) * height for i in range(len(rows))]
            measured = [(p["devices"].get(d) or {}).get("measured_mib") or 0 for p in rows]
            errors = [(p["devices"].get(d) or {}).get("error_mib") or 0 for p in rows]
            ax_mib.barh(ys, [m / 1024 for m in measured], height, label=d)
            ax_err.barh(ys, errors, height, label=d)
        ax_err.axvspan(-256, 256, color="0.9", zorder=0, label="256 MiB (the goal: max(3%, 256 MiB))")
        ax_err.axvline(0, color="0.3", lw=0.8)
        ax_mib.set_yticks(range(len(rows)), [p["name"] for p in rows], fontsize=8)
        ax_err.set_yticks(range(len(rows)), [""] * len(rows))
        ax_mib.invert_yaxis()
        ax_err.invert_yaxis()
        ax_mib.set_title(label, fontsize=9, loc="left")
        ax_mib.set_xlabel("measured peak VRAM per GPU (GiB)")
        ax_err.set_xlabel("predicted - measured (MiB; > 0: predicted high)")
        ax_mib.legend(fontsize=8, loc="lower right")
        ax_err.legend(fontsize=7, loc="best", framealpha=0.9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def torch_section(recs: list[dict[str, Any]]) -> list[str]:
    """The torch runtime's table: per plan and GPU the engine's peak against the engine's own prediction (records
    made before it: planner.memory's), and both sides' parts (where a gap comes from)."""
    L = ["## Torch runtime: predicted vs measured per device", ""]
    if not recs:
        return L + ["No torch plan measured yet.", ""]
    r0 = recs[0]
    eng = r0.get("engine") or {}
    logical = any(r.get("logical_gpus") for r in recs)
    where = ("two logical GPUs on the CPU (the engine's stand-in: its accountant's peak of weights, KV, staging "
             "and the live activations between ops; no CUDA context, so the prediction is compared without its "
             "overhead)" if logical else
             "cuda:0 / cuda:1 (" + ", ".join(eng.get("gpus") or []) + "): torch.cuda.max_memory_allocated + the CUDA "
             "context and library overhead measured once per device, as the one-GPU torch benchmarks measure")
    wl = r0.get("workload") or {}
    cuda = "" if logical else (f", torch.compile {'on' if eng.get('compile') else 'off'}, CUDA graphs "
                               f"{'on' if eng.get('cuda_graphs') else 'off'}")
    L += [f"The bundled PyTorch engine (torch {eng.get('torch', '?')}, {eng.get('compute_dtype', 'bf16')}, synthetic "
          f"weights{cuda}) on {where}. Model {r0['model']} "
          f"({r0.get('model_gib', 0):.1f} GiB); the memory table's placements (flags: what they render as for "
          f"llama-bench), context {r0.get('knobs', {}).get('n_ctx', '?')}. predicted = "
          + (f"the torch engine's own memory model (TorchEngine.predict_memory: a dry run of its placement and "
             f"accountant, what `tune --engine torch` judges plans with; planner.memory's llama.cpp estimate in the "
             f"JSON beside it) with hardware '{r0['hardware']}' (its GPU overhead, the torch engine's CUDA context "
             f"on the H100, added on real GPUs)"
             if "memory_model" in r0 else
             f"planner.memory's estimate with hardware '{r0['hardware']}' (runs recorded before the torch engine "
             "had its own memory model)")
          + "; error = predicted - measured; goal |error| <= max(3%, "
          "256 MiB) on each GPU. engine parts = weights + KV + staging (upload buffers of RAM weights) + "
          "activations (the rest of the peak) + context; pred parts = weights + KV + compute + overhead. device "
          "peak: the GPU's memory in use (NVML / nvidia-smi) during the run less its reading before the torch "
          "process started (allocator cache, graph pools and loaded kernels included).", ""]
    if wl:
        L[-2] = L[-2].rstrip() + f" BenchRun PP {wl.get('n_prompt')} TG {wl.get('n_gen')}."
    L += ["| plan | flags | PP t/s | TG t/s | CUDA0 measured | predicted | error | ok | CUDA1 measured | predicted | "
          "error | ok | engine parts CUDA0 | engine parts CUDA1 | pred parts CUDA0 | pred parts CUDA1 | device peak "
          "CUDA0 / CUDA1 |",
          "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|---|---|---|---|"]
    for p in recs:
        m = p["measurement"]
        pp = f"{m['pp_tps']:.1f}" if m["ok"] else f"FAILED: {m['error'][:60]}"
        cells, eparts, pparts, peaks = [], [], [], []
        for d in GPUS:
            r = p["devices"].get(d)
            if r is None:
                cells += ["-"] * 4
                eparts.append("-")
                pparts.append("-")
                peaks.append("-")
                continue
            cells += _check_cells(r)
            e = r["engine_parts"]
            eparts.append("+".join(_mib(e[k]) for k in ("weights", "kv", "staging", "activations", "context")))
            pr = r["predicted_parts"]
            pparts.append(_pred_parts(pr))
            peaks.append(_mib(r.get("device_peak_bytes")))
        flags = _flags_cell(p["flags"], 100)
        L.append(f"| {p['name']} | `{flags}` | {pp} | {m['tg_tps']:.2f} | " + " | ".join(cells) + " | "
                 + " | ".join(eparts) + " | " + " | ".join(pparts) + " | " + " / ".join(peaks) + " |")
    sm = memory_summary(recs)
    over = [f"{p['name']} {d}" for p in recs for d, r in p["devices"].items() if r["within_goal"] is False]
    L += ["", f"{sm['device_checks_within_goal']} of {sm['device_checks']} per-GPU peaks within the goal "
          f"({sm['plans_within_goal']} of {sm['plans_measured']} plans on both GPUs)"
          + (f"; over: {', '.join(over)}" if over else "") + ".", ""]
    return L


# ---- main ------------------------------------------------------------------------------------------------------------

def bench_default_threads(bench: Path) -> int | None:
    """llama-bench's own default -t (its --help: physical cores), what --fit's run uses."""
    try:
        text = subprocess.run([str(bench), "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"-t, --threads <n>\s+\(default: (\d+)\)", text)
    return int(m.group(1)) if m else None


def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except (BadInput, InputError) as e:
        print(f"multi_gpu: {e}", file=sys.stderr)
        return 2


def run(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    opts.add_call_options(ap, name="multi_gpu", workdir=DEFAULT_WORKDIR, time_budget=540.0, min_left=40.0,
                          timeout=240.0, cpu_help="the CPU build and a tiny model (no GPU)",
                          min_left_help="a memory run needs to start", hardware_help="its GPU twice")
    ap.add_argument("--llama-bench", type=Path, help="default <llamacpp_gpu workdir>/llama.cpp-cuda/build/bin/...")
    ap.add_argument("--model", type=Path, help="default the llamacpp_gpu benchmark's model (written if missing)")
    opts.add_step_options(ap, STEPS, plans="memory plans", listed="memory (and torch) plans")
    ap.add_argument("--budgets", default=None, help="GiB per GPU (default 8,16; 1 with --cpu)")
    opts.add_workload_options(ap, DEFAULTS, what="memory and torch runs")
    opts.add_workload_options(ap, DEFAULTS, what="study runs", prefix="tune-")
    opts.add_study_options(ap, DEFAULTS)
    ap.add_argument("--confirm-run-s", type=float, help="seconds one run takes, to plan the confirmation into one "
                    "call before this call has timed 3 runs of its own "
                    f"({opts.default_text(DEFAULTS, 'confirm_run_s')})")
    ap.add_argument("--cell-min-left", type=float, default=180.0,
                    help="seconds a budget cell needs to start (its baselines run in one go; default 180)")
    ap.add_argument("--model-min-left", type=float, default=200.0,
                    help="seconds the model write needs; with less left it waits for the next call (default 200)")
    ap.add_argument("--threads", type=int, help="host threads of the study's plans (default llama-bench's own)")
    ap.add_argument("--torch-layers", type=int, help=f"torch step: layers of the {TORCH_PRESET} shape (default "
                    f"{TORCH_LAYERS}; with --cpu 0: a tiny qwen3moe)")
    ap.add_argument("--torch-plans", default="", help="comma list of torch plans to run (default all)")
    ap.add_argument("--torch-budgets", default=None, help="torch step: GiB per GPU of the planner's own plans "
                    f"(default {','.join(map(str, TORCH_BUDGETS))}; 1 with --cpu and the tiny model)")
    ap.add_argument("--torch-hardware", default=str(TORCH_HARDWARE),
                    help="torch step: the profile its predictions use (default the one-GPU torch benchmarks')")
    ap.add_argument("--torch-first-s", type=float, help="seconds the first torch plan of a process needs to start "
                    f"(compiling, autotuning; default {TORCH_FIRST_RUN_S:.0f}, 0 with --cpu)")
    ap.add_argument("--torch-in-process", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--meta", type=Path, help=argparse.SUPPRESS)      # the parent's meta, for a torch child
    ap.add_argument("--note", type=Path, help="a Markdown file of notes for the report")
    args = opts.resolve(ap, ap.parse_args(argv), DEFAULTS)
    t_start = time.monotonic()
    steps = opts.parse_steps(ap, args.steps, STEPS)
    args.plans = [p for p in args.plans.split(",") if p]
    args.torch_plans = [p for p in args.torch_plans.split(",") if p]
    args.torch_layers = args.torch_layers if args.torch_layers is not None else (0 if args.cpu else TORCH_LAYERS)
    args.budgets = opts.parse_budgets(ap, args.budgets or ("1" if args.cpu else "8,16"))
    args.torch_budgets = opts.parse_budgets(ap, args.torch_budgets or ("1" if args.torch_layers <= 0 else
                                                                       ",".join(map(str, TORCH_BUDGETS))),
                                            "--torch-budgets")
    args.torch_first_s = args.torch_first_s if args.torch_first_s is not None else (0.0 if args.cpu
                                                                                    else TORCH_FIRST_RUN_S)
    workdir = args.workdir or (DEFAULT_WORKDIR.with_name("multi_gpu_cpu") if args.cpu else DEFAULT_WORKDIR)
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else workdir / "report")
    results_dir = workdir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    args.storage = f"sqlite:///{workdir / 'multi_gpu.db'}"
    wl = BenchRun(args.n_prompt, args.n_gen, 0, args.reps)
    if args.model is not None and not args.model.is_file():
        raise BadInput(f"--model {args.model}: no such file")
    llama_steps = bool({"memory", "tune"} & set(steps))
    meta: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
                            "cpu_mode": args.cpu, "binary": None, "devices": {}, "gpu": None, "vram_source": None,
                            "model": None, "model_gib": None, "hardware": f"{args.hardware} x{len(GPUS)}",
                            "threads": None, "goal": "max(3%, 256 MiB) per GPU", "case_order": [],
                            "memory_workload": {"n_prompt": wl.n_prompt, "n_gen": wl.n_gen,
                                                "repetitions": wl.repetitions},
                            "n_prompt": args.tune_n_prompt, "n_gen": args.tune_n_gen, "reps": args.tune_reps,
                            "runs": args.runs, "confirm": args.confirm, "budgets_gib_per_gpu": args.budgets}
    if args.meta is not None and args.meta.is_file():
        meta.update(json.loads(args.meta.read_text()))
    engine = inv = hw = hw0 = None
    cases: list[Case] = []
    bench = model = None
    if llama_steps or (args.list and "torch" not in steps):
        if args.cpu:
            from runtime.llamacpp_build import ensure_built
            bench = args.llama_bench or ensure_built()["llama-bench"]
        else:
            bench = args.llama_bench or lg.DEFAULT_WORKDIR / "llama.cpp-cuda" / "build" / "bin" / "llama-bench"
        if not bench.exists():
            raise BadInput(f"no llama-bench at {bench}: run `bash benchmarks/llamacpp_gpu.sh build TARBALL` first")
        model = args.model or (workdir / "tiny-qwen3moe-q4_0.gguf" if args.cpu
                               else lg.DEFAULT_WORKDIR / "qwen3-30b-a3b-q4_0.gguf")
        if not model.exists() and not args.cpu and lg.time_left(args, t_start) < args.model_min_left:
            log(f"model: not written in this call ({lg.time_left(args, t_start):.0f} s left of --time-budget); "
                "run again")
            return 3
        lg.write_model(model, args.cpu)
        inv = load_inventory(model)
        if model.resolve().is_relative_to(ROOT):
            # the plans' and studies' model id: the path from the repository root, the same on every machine the
            # state travels to (the engine runs the file itself by its full path)
            inv = replace(inv, source=str(model.resolve().relative_to(ROOT)))
        engine = LlamaCppEngine(bench, timeout_s=args.timeout, model_path=model, verbose=True)
        devs = engine.devices() or {}
        gpu_bytes = [devs[d]["total_bytes"] for d in GPUS if d in devs] or [DEFAULT_GPU_BYTES] * len(GPUS)
        if len(gpu_bytes) < len(GPUS):
            gpu_bytes = [gpu_bytes[0]] * len(GPUS)
        hw0 = load_hardware(args.hardware)
        threads = args.threads or bench_default_threads(bench) or hw0.host.n_threads
        hw0 = replace(hw0, host=replace(hw0.host, n_threads=threads))
        hw = hw0.with_vram(gpu_bytes)
        cases = make_cases(inv, hw, args.budgets, wl.n_prompt)
        unknown = [p for p in args.plans if p not in {c.name for c in cases}]
        if unknown and not args.list:
            raise BadInput(f"unknown plan {unknown[0]!r}; --list shows them")
        if not args.cpu and sum(1 for d in devs if d.startswith("CUDA")) < len(GPUS):
            log(f"warning: llama-bench lists {', '.join(devs) or 'no GPU'}; two GPUs are needed (use --cpu for a dry "
                "run)")
        meta.update({"binary": engine.info.to_dict(), "devices": devs,
                     "gpu": ", ".join(f"{d}: {v['description']}" for d, v in devs.items()) or None,
                     "vram_source": engine.sampler().source if engine.sampler() else "none",
                     "model": str(model), "model_gib": model.stat().st_size / GiB, "threads": threads,
                     "case_order": [c.name for c in cases]})
    if args.list:
        for c in cases:
            print(f"{c.name:30s} {c.what}")
        if "torch" in steps:
            tinv = torch_inventory(args.torch_layers)
            print(f"\ntorch step ({tinv.name}, {tinv.total_bytes() / GiB:.1f} GiB):")
            for c in torch_cases(tinv, torch_hardware(args.torch_hardware), args.torch_budgets, torch_workload(args)):
                print(f"{c.name:30s} {c.what}")
        return 0
    if args.note:
        meta["note"] = args.note.read_text()
    state = out_dir / f"{args.name}_state.tar.gz"

    def write_report() -> None:     # after every plan and cell, so a call cut off still returns a report
        rows = budget_rows(args.storage, args.budgets) if (workdir / "multi_gpu.db").exists() else []
        report(meta, lg.load_results(results_dir, "plan"), rows, out_dir, args.name,
               lg.load_results(results_dir, "torch"))
        opts.pack_state(workdir, "multi_gpu.db", state)

    done = True
    if "memory" in steps:
        done = run_memory(args, engine, inv, hw, cases, wl, results_dir, t_start, write_report)
    if "torch" in steps and done:
        if "tune" in steps and not args.torch_in_process:
            meta_path = workdir / "call_meta.json"        # not state: this call's meta for the child's reports
            lg.write_json(meta_path, meta)
            try:
                done = run_torch_child(args, argv, t_start, meta_path)
            finally:
                meta_path.unlink(missing_ok=True)
        else:
            done = run_torch(args, results_dir, t_start, write_report)
    if "tune" in steps and done:
        tune_engine = TimedEngine(LlamaCppEngine(bench, timeout_s=args.timeout, model_path=model,
                                                 cpu_stand_in=args.cpu))
        done = run_tune(args, tune_engine, inv, hw0, t_start, write_report)
    write_report()
    missing = [c.name for c in cases if not (results_dir / f"plan-{c.name}.json").exists()]
    if "memory" in steps and missing:
        log(f"memory: not measured yet: {', '.join(missing)}")
    log("all done" if done else "work left: run again")
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())
