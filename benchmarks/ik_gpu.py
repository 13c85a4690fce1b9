"""ik_llama.cpp on the GPU, measured (issue 11 item 6), on the synthetic Qwen3-30B-A3B-shaped Q4_0 model of
benchmarks/llamacpp_gpu.py (17 GB, written once), with the CUDA ik build of `llamacpp_gpu.sh build-ik`:

- memory: >= 12 ik plans measured with ik's llama-sweep-bench (all-GPU, -ngl N, -ot exps=CPU, -ncmoe N,
  per-tensor -ot, fused MoE off, -amb, q8_0 KV at a long context, ubatch 512/2048, op offload off): peak VRAM
  predicted by planner.memory (dialect ik, HardwareProfile gpu-box) against measured, |error| against the goal
  max(3%, 256 MiB), and ik's own logged buffers (model / KV / compute) against the memory model's parts;
- mla: the same on DeepSeek's MLA graphs, which ik builds differently on a GPU build (F16 casts, where its
  scheduler puts MLA nodes): a DeepSeek-V2-Lite-shaped Q4_0 model (8.2 GB, written once), -mla 0/1/2/3 with flash
  attention on and off, -amb, ubatch 512/2048, experts in RAM, a split -ngl, a long context with f16 / q8_0 cache;
- op: what -op buys with the experts in RAM (-ngl 99 -ot exps=CPU): PP at ubatch 512 and 2048 with the GPU
  offload of MUL_MAT_ID and of MOE_FUSED_UP_GATE on / off (ik's -op ids from planner/flags/ik.py for the
  build), every configuration once per round, rounds interleaved (A B C .. A B C ..), medians and [min-max];
- study: an ik tune study per budget (default 8 and 16 GiB, depth 0, -p 2048 -n 64 as tune_vs_fit uses) on
  llama-sweep-bench, so its --fit baseline is ik's own --fit (LlamaCppEngine.own_fit: -c CTX --fit
  --fit-margin M) and its confirmation interleaves it; at most --runs engine runs per cell; cells "ik-<B>g-d0"
  in <workdir>/ik_gpu.db;
- mainline (with --mainline-bench): per budget, interleaved in one call, ik's best TG config and ik's --fit
  (llama-sweep-bench) against mainline's --fit (llama-bench -fitt, the mainline engine's own_fit) and, when
  --mainline-db holds the tune_vs_fit study of that budget, mainline's confirmed best TG config. TG is
  comparable; PP is not the same measure (sweep-bench: one ubatch at depth 0; llama-bench: -p 2048).

Writes NAME.json and NAME.md (--name, default ik_gpu) to --out (default $OUT, else <workdir>/report), rewritten
after every result; the study step also writes NAME_study.{md,png} (tune_vs_fit's report of the ik cells).

Resumable across 10-minute device calls: every result is a file under <workdir>/results (the study: Optuna in
<workdir>/ik_gpu.db), skipped on the next call (--redo measures again); no run starts with less than
--min-left seconds of --time-budget left. After every result --out also gets ik_gpu_state.tgz, both of them:
`tar xzf OUT/ik_gpu_state.tgz -C WORKDIR` on a fresh machine (or here) goes on from there. Exit 3 while work
is left, 0 when every step asked for is done, 2 on bad input. Steps run in the order memory, op, study,
mainline; --steps picks some.

Time on the H100 (a sweep-bench run of the 17 GB model: ~10-20 s, most of it loading; llama-bench -p 2048 -n 64
-r 3 with experts in RAM ~20-30 s), so with --time-budget 520 per call:
    memory    18 plans (2 at an 8k context: ~30 s each)      ~5-6 min    1-2 calls
    mla       14 plans of the 8.2 GB model (~10 s each)     ~3 min      1 call
    op        8 configurations x 3 rounds = 24 runs         ~5-7 min    1-2 calls
    study     2 cells x <= 24 runs (+ Optuna, a few s each) ~12-16 min  2-3 calls
    mainline  2 budgets x 3-4 contenders x 3 rounds         ~6-9 min    1-2 calls
On the GPU machine, after `bash benchmarks/llamacpp_gpu.sh build-ik` (and the mainline `build` for the last step:
its llama-bench is found in the llamacpp_gpu workdir; without it the mainline step is skipped):
    python3 benchmarks/ik_gpu.py --name ik_gpu_h100 --time-budget 520
repeated until it exits 0 (the first call writes the model, ~3 min, if llamacpp_gpu.py has not).
Here, without a GPU, the whole pipeline on the CPU ik build and tiny models, every plan run all-CPU (the CPU
build's --fit cannot fit anything: the stand-in drops it; ~1 min on 2 cores):
    .venv/bin/python benchmarks/ik_gpu.py --cpu
After a change to the memory model, a stored GPU report's memory plans predicted again (no runs, no GPU, no model
file: the synthetic model's inventory is rebuilt from its preset), REPORT_repredict.{md,json} beside it:
    .venv/bin/python benchmarks/ik_gpu.py --repredict benchmarks/reported/ik_gpu_h100.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
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
from planner.errors import InputError  # noqa: E402
from planner.gguf_header import load_inventory  # noqa: E402
from planner.hardware import GiB, MiB, HardwareProfile, load_hardware  # noqa: E402
from planner.memory import estimate  # noqa: E402
from planner.model import ModelInventory, Tensor  # noqa: E402
from planner.plan import Knobs, OffloadPolicy, OpRule, Plan  # noqa: E402
from tuner.records import StudyRecord, TrialRecord  # noqa: E402
from planner.engine_contract import BenchRun  # noqa: E402
from runtime.llamacpp import LlamaCppEngine, sweep_ctx  # noqa: E402

STEPS = ("memory", "mla", "op", "study", "mainline")
DEFAULTS: opts.Defaults = {"runs": (24, 12), "confirm": (3, 2), "rounds": (3, 2), "n_prompt": (2048, 32),
                           "n_gen": (64, 4), "reps": (3, 1)}
DEFAULT_WORKDIR = ROOT / "benchmarks" / "results" / "ik_gpu"
IK_BIN = lg.DEFAULT_WORKDIR / "ik_llama.cpp-cuda" / "build" / "bin"
MODEL = lg.DEFAULT_WORKDIR / "qwen3-30b-a3b-q4_0.gguf"
MLA_PRESET = "DeepSeek-V2-Lite"
MLA_MODEL = lg.DEFAULT_WORKDIR / "deepseek-v2-lite-q4_0.gguf"
# --cpu: ik takes a mainline-converted MLA model (one KV head) only with DeepSeek's own widths, K 576 = kv_lora 512 +
# rope 64 and V 512 (src/llama-hparams.cpp ~1083), as tests/runtime/test_ik_binaries.py's tiny DeepSeek has them
TINY_DEEPSEEK = {"arch": "deepseek2", "kv_lora_rank": 512, "n_rot": 64, "head_dim_k": 576, "head_dim_v": 512,
                 "head_dim_k_mla": 128, "head_dim_v_mla": 64}
MAINLINE_DB = ROOT / "benchmarks" / "results" / "tune_vs_fit" / "tune_vs_fit.db"
MAINLINE_BENCH = lg.DEFAULT_WORKDIR / "llama.cpp-cuda" / "build" / "bin" / "llama-bench"
PARTS = ("weights", "kv", "compute", "overhead", "pool")   # planner.memory.DeviceMemory, in the report's order
STATE_NAME = "ik_gpu_state.tgz"   # the workdir's results and study database, as --out gets them after each result
LONG_CTX = 8192              # the depth of the long-context memory plans (KV of f16 vs q8_0); --cpu: 1024
log = lg.log


class BadInput(Exception):
    """One line for the user, exit 2."""


# ---- plans -----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IkCase:
    name: str
    what: str
    plan: Plan
    depth: int = 0           # sweep-bench's row: -c grows to hold it (KV for depth + ubatch tokens)


def _ik(inv: ModelInventory, name: str, on_gpu: Callable[[Tensor], bool], knobs: Knobs) -> Plan:
    return Plan(str(inv.source), lg.placement(inv, on_gpu), knobs, "ik", name)


def make_cases(inv: ModelInventory, hw: HardwareProfile, budgets: list[int], n_prompt: int,
               long_ctx: int = LONG_CTX) -> list[IkCase]:
    """The memory table's plans (ik dialect): whole layers, experts in RAM, per-tensor overrides, ik's knobs."""
    n_layer, moe = inv.hparams.n_layer, inv.moe_layers()
    half, most = n_layer // 2, (5 * n_layer) // 6
    k40 = max(1, round(0.4 * len(moe)))
    first, last_half = set(moe[:k40]), set(moe[len(moe) // 2:])
    base = Knobs(n_ctx=n_prompt, n_batch=2048, n_ubatch=512)
    ub2048 = replace(base, n_ubatch=2048)
    moe_off = OffloadPolicy(moe_matmul=OpRule(False), moe_fused_up_gate=OpRule(False))

    def dense(t: Tensor) -> bool:
        return not t.is_expert

    def experts(pred: Callable[[Tensor], bool]) -> Callable[[Tensor], bool]:
        return lambda t: dense(t) or pred(t)

    def blocks_from(k: int) -> Callable[[Tensor], bool]:
        return lambda t: t.layer is not None and t.layer >= k

    q8 = replace(base, type_k="q8_0", type_v="q8_0")
    specs = [
        ("all-gpu", "every tensor but token_embd on the GPU (-ngl 99)", lambda t: True, base, 0),
        ("all-gpu-ub2048", "as all-gpu, -ub 2048", lambda t: True, ub2048, 0),
        (f"ngl{most}", f"the last {most} blocks on the GPU, output in RAM (-ngl {most})", blocks_from(n_layer - most),
         base, 0),
        (f"ngl{half}", f"the last {half} blocks on the GPU (-ngl {half})", blocks_from(n_layer - half), base, 0),
        ("exps-cpu", "attention/norms/router on the GPU, every expert in RAM (-ngl 99 -ot exps=CPU)", dense, base, 0),
        ("exps-cpu-ub2048", "as exps-cpu, -ub 2048", dense, ub2048, 0),
        ("exps-cpu-nofmoe", "as exps-cpu, fused MoE off (-no-fmoe)", dense, replace(base, fmoe=False), 0),
        ("exps-cpu-amb512", "as exps-cpu, -amb 512", dense, replace(base, amb=512), 0),
        ("exps-cpu-moe-op-off", "as exps-cpu, -ub 2048, MUL_MAT_ID and MOE_FUSED_UP_GATE offload off (-op)", dense,
         replace(ub2048, offload=moe_off), 0),
        (f"ncmoe{len(moe) // 2}", f"-ngl 99 -ncmoe {len(moe) // 2}: experts of the last {len(moe) // 2} MoE blocks "
         "in RAM", experts(lambda t: t.layer not in last_half), base, 0),
        (f"exps-first{k40}", f"attn + experts of the first {k40} MoE blocks on the GPU (per-block -ot)",
         experts(lambda t: t.layer in first), base, 0),
        ("up-gate-all", "attn + ffn_up/ffn_gate experts of every block on the GPU, ffn_down in RAM (per-tensor -ot)",
         experts(lambda t: t.role in ("exps_up", "exps_gate")), base, 0),
        ("down-all", "attn + ffn_down experts on the GPU, up/gate in RAM (per-tensor -ot)",
         experts(lambda t: t.role == "exps_down"), base, 0),
        (f"exps-first{k40}-ub2048", f"as exps-first{k40}, -ub 2048", experts(lambda t: t.layer in first), ub2048, 0),
        ("all-gpu-long", f"all-gpu with the row at depth {long_ctx} (f16 KV)", lambda t: True, base, long_ctx),
        ("all-gpu-long-q8kv", f"all-gpu at depth {long_ctx}, q8_0 KV (-ctk q8_0 -ctv q8_0)", lambda t: True, q8,
         long_ctx),
    ]
    cases = [IkCase(n, w, _ik(inv, n, f, k), d) for n, w, f, k, d in specs]
    return cases + planner_cases(inv, hw, base, budgets, n_prompt)


def planner_cases(inv: ModelInventory, hw: HardwareProfile, base: Knobs, budgets: list[int], n_prompt: int
                  ) -> list[IkCase]:
    from planner.errors import BudgetError
    from planner.propose import best_plans
    out = []
    for b in budgets:
        try:
            best = best_plans(inv, hw.with_vram([b * GiB]), base, "ik", "tg", lg.GOAL_FLOOR, n_prompt)[0]
        except BudgetError as e:
            log(f"memory: no planner plan at {b} GiB: {e}")
            continue
        name = f"planner-{b}G"
        out.append(IkCase(name, f"offload-tuner plan's best TG plan for {b} GiB ({best.plan.label})",
                          replace(best.plan, model_id=str(inv.source), label=name)))
    return out


def mla_cases(inv: ModelInventory, n_prompt: int, long_ctx: int = LONG_CTX) -> list[IkCase]:
    """DeepSeek's MLA plans (ik dialect): each -mla, flash attention on / off, -amb, the ubatch, experts in RAM, a
    split -ngl (ik runs -mla 3 there whatever was asked: planner.memory.ik_mla_plan), a long context."""
    n_layer = inv.hparams.n_layer
    half = n_layer // 2
    base = Knobs(n_ctx=n_prompt, n_batch=2048, n_ubatch=512, mla=3)
    ub2048 = replace(base, n_ubatch=2048)

    def every(t: Tensor) -> bool:
        return True

    def dense(t: Tensor) -> bool:
        return not t.is_expert

    specs = [
        ("ds-mla3", "-mla 3 -fa on, every tensor but token_embd on the GPU (-ngl 99)", every, base, 0),
        ("ds-mla3-ub2048", "as ds-mla3, -ub 2048", every, ub2048, 0),
        ("ds-mla2", "as ds-mla3, -mla 2", every, replace(base, mla=2), 0),
        ("ds-mla1", "as ds-mla3, -mla 1", every, replace(base, mla=1), 0),
        ("ds-mla0", "as ds-mla3, -mla 0 (attn_kv_b computed at load)", every, replace(base, mla=0), 0),
        ("ds-mla3-nofa", "as ds-mla3, flash attention off", every, replace(base, flash_attn=False), 0),
        ("ds-mla1-nofa", "-mla 1, flash attention off", every, replace(base, mla=1, flash_attn=False), 0),
        ("ds-mla2-nofa-ub2048-amb256", "-mla 2, flash attention off, -ub 2048 -amb 256", every,
         replace(ub2048, mla=2, flash_attn=False, amb=256), 0),
        ("ds-mla3-ub2048-amb256", "as ds-mla3-ub2048, -amb 256", every, replace(ub2048, amb=256), 0),
        ("ds-exps-cpu", "-mla 3, every expert in RAM (-ngl 99 -ot exps=CPU)", dense, base, 0),
        ("ds-exps-cpu-ub2048", "as ds-exps-cpu, -ub 2048 (the MoE ops offloaded)", dense, ub2048, 0),
        (f"ds-ngl{half}-mla1", f"the last {half} blocks on the GPU, -mla 1 asked (ik runs -mla 3 on a split)",
         lambda t: t.layer is not None and t.layer >= n_layer - half, replace(base, mla=1), 0),
        ("ds-mla3-long", f"ds-mla3 with the row at depth {long_ctx} (f16 cache)", every, base, long_ctx),
        ("ds-mla3-long-q8kv", f"ds-mla3 at depth {long_ctx}, q8_0 cache", every,
         replace(base, type_k="q8_0", type_v="q8_0"), long_ctx),
    ]
    return [IkCase(n, w, _ik(inv, n, f, k), d) for n, w, f, k, d in specs]


OP_POLICIES = {
    "on": OffloadPolicy(),
    "mmid-off": OffloadPolicy(moe_matmul=OpRule(False)),
    "fug-off": OffloadPolicy(moe_fused_up_gate=OpRule(False)),
    "both-off": OffloadPolicy(moe_matmul=OpRule(False), moe_fused_up_gate=OpRule(False)),
}
OP_WHAT = {"on": "ik's default: every op offloaded", "mmid-off": "MUL_MAT_ID offload off",
           "fug-off": "MOE_FUSED_UP_GATE offload off", "both-off": "both off"}


def op_cases(inv: ModelInventory) -> list[IkCase]:
    """Experts in RAM at ubatch 512 and 2048, each with the MoE ops' GPU offload on / off."""
    out = []
    for ub in (512, 2048):
        for key, pol in OP_POLICIES.items():
            knobs = Knobs(n_ctx=ub, n_batch=max(2048, ub), n_ubatch=ub, offload=pol)
            name = f"ub{ub}-{key}"
            out.append(IkCase(name, f"-ngl 99 -ot exps=CPU -ub {ub}: {OP_WHAT[key]}",
                              _ik(inv, name, lambda t: not t.is_expert, knobs)))
    return out


# ---- measuring -------------------------------------------------------------------------------------------------------

@dataclass
class Ctx:
    """What every step needs: the arguments, the ik engine, the model, the hardware, where results go."""
    args: argparse.Namespace
    engine: LlamaCppEngine
    inv: ModelInventory
    hw: HardwareProfile
    results: Path
    deadline: float
    after_each: Callable[[], None]

    def time_ok(self, what: str) -> bool:
        left = self.deadline - time.monotonic()
        if left < self.args.min_left:
            log(f"{what}: stopping, {left:.0f} s left of --time-budget; run again to continue")
            return False
        return True

    def done(self, name: str) -> bool:
        return (self.results / f"{name}.json").exists() and not self.args.redo

    def keep(self, name: str, rec: dict[str, Any]) -> None:
        lg.write_json(self.results / f"{name}.json", rec)
        self.after_each()


def _run_plan(c: Ctx, case: IkCase, wl: BenchRun) -> tuple[Any, Plan, str]:
    """The case's run (all-CPU with --cpu), the plan that ran, and the GPU command line it stands for."""
    ran = lg.cpu_variant(case.plan) if c.args.cpu else case.plan
    gpu_cmd = c.engine.command(c.inv, case.plan, wl).shell
    return c.engine.measure(c.inv, ran, wl), ran, gpu_cmd


def _at_ctx(plan: Plan, wl: BenchRun) -> Plan:
    return replace(plan, knobs=replace(plan.knobs, n_ctx=sweep_ctx(plan.knobs.n_ubatch, plan.knobs.n_batch, wl)))


def measure_memory_case(c: Ctx, case: IkCase) -> dict[str, Any]:
    wl = BenchRun(case.plan.knobs.n_ubatch, c.args.mem_gen, case.depth, 1)
    t0 = time.monotonic()
    m, ran, gpu_cmd = _run_plan(c, case, wl)
    pred = estimate(c.inv, _at_ctx(case.plan, wl), c.hw).to_dict()["devices"]
    # the log and the model's parts on the device that ran: the GPU, or the CPU in the dry run
    dev = "CPU" if c.args.cpu else "CUDA0"
    parts = estimate(c.inv, _at_ctx(ran, wl), c.hw).to_dict()["devices"].get(dev)
    measured = None if c.args.cpu else m.peak_bytes.get("CUDA0")
    k = case.plan.knobs
    return {"name": case.name, "what": case.what, "depth": case.depth, "n_ctx": sweep_ctx(k.n_ubatch, k.n_batch, wl),
            "knobs": {"n_ubatch": k.n_ubatch, "n_batch": k.n_batch, "fmoe": k.fmoe, "amb": k.amb,
                      "type_k": k.type_k, "op_offload": k.offload.any_enabled},
            "command": gpu_cmd, "ran": m.raw.get("command"), "cpu_mode": c.args.cpu,
            "seconds": round(time.monotonic() - t0, 1), "measurement": m.to_dict(), "predicted": pred,
            "cuda0": lg.compare(pred.get("CUDA0", {"total": 0}), measured),
            "log_device": dev, "log": lg.log_device(m.raw, dev), "predicted_parts": parts}


def step_memory(c: Ctx, cases: list[IkCase], prefix: str = "mem", step: str = "memory") -> bool:
    """Each plan once: its peak VRAM against the prediction (step "mla": the MLA model's, results "mla-*")."""
    wanted = [x for x in cases if not c.args.plans or x.name in c.args.plans]
    for i, case in enumerate(wanted):
        if c.done(f"{prefix}-{case.name}"):
            continue
        if not c.time_ok(step):
            return False
        log(f"{step}: [{i + 1}/{len(wanted)}] {case.name}: {case.what}")
        rec = measure_memory_case(c, case)
        m, c0 = rec["measurement"], rec["cuda0"]
        log(f"{step}: {case.name}: {'ok' if m['ok'] else 'FAILED ' + m['error']}; PP {m['pp_tps']:.1f} TG "
            f"{m['tg_tps']:.2f}; VRAM measured {lg._mib(c0['measured_bytes'])} predicted "
            f"{lg._mib(c0['predicted_bytes'])} MiB ({rec['seconds']} s)")
        c.keep(f"{prefix}-{case.name}", rec)
    return True


def step_op(c: Ctx, cases: list[IkCase]) -> bool:
    """Every configuration once per round, the rounds in order: a cut-off call resumes at the next sample."""
    for r in range(c.args.rounds):
        for case in cases:
            key = f"op-r{r}-{case.name}"
            if c.done(key):
                continue
            if not c.time_ok("op"):
                return False
            wl = BenchRun(case.plan.knobs.n_ubatch, c.args.op_gen, 0, c.args.reps)
            m, _, gpu_cmd = _run_plan(c, case, wl)
            log(f"op: round {r + 1}/{c.args.rounds} {case.name}: {'ok' if m.ok else 'FAILED ' + m.error}; "
                f"PP {m.pp_tps:.1f} TG {m.tg_tps:.2f}")
            c.keep(key, {"round": r, "name": case.name, "what": case.what, "n_ubatch": case.plan.knobs.n_ubatch,
                         "command": gpu_cmd, "measurement": m.to_dict()})
    return True


# ---- the ik study, and mainline against it ---------------------------------------------------------------------------

def cell_name(budget_gib: int, depth: int = 0) -> str:
    return f"ik-{budget_gib}g-d{depth}"


def study_args(c: Ctx) -> argparse.Namespace:
    """The fields tune_vs_fit's helpers read, for the ik cells."""
    a = c.args
    return argparse.Namespace(n_prompt=a.n_prompt, n_gen=a.n_gen, reps=a.reps, storage=a.storage, seed=a.seed,
                              pool=a.pool, runs=a.runs, confirm=a.confirm)


def run_cell(c: Ctx, budget_gib: int) -> bool:
    """One ik cell (baselines with ik's own --fit first, search, confirmation), as tune_vs_fit runs a mainline one."""
    import tune_vs_fit as tvf
    return tvf.run_cell(study_args(c), c.engine, c.inv, c.hw, budget_gib, 0, c.deadline, dialect="ik",
                        study_name=cell_name(budget_gib), checkpoint=c.after_each)


def step_study(c: Ctx) -> bool:
    for b in c.args.budgets:
        if not c.time_ok(cell_name(b)):       # a baseline in flight is not stopped at the deadline
            return False
        ok = run_cell(c, b)
        log(f"{cell_name(b)}: {'confirmed' if ok else 'not finished: run again'}")
        if not ok:
            return False
    return True


def load_study(storage_url: str, name: str):
    """The Optuna study of that name in that storage, or None."""
    import optuna
    from tuner.storage import make_storage
    storage = make_storage(storage_url)
    if name not in {s.study_name for s in storage.get_all_studies()}:
        return None
    return optuna.load_study(study_name=name, storage=storage)


def study_rows(c: Ctx) -> list[dict[str, Any]]:
    import tune_vs_fit as tvf
    rows = []
    for b in c.args.budgets:
        st = load_study(c.args.storage, cell_name(b))
        if st is not None:
            row = tvf.cell_row(st, b, 0)
            fit = next((x for x in StudyRecord.of(st).baselines or [] if x.get("kind") == "engine-fit"), {})
            row["ik_fit_note"], row["ik_fit_chosen"] = fit.get("note", ""), " ".join(fit.get("chosen_args", []))
            rows.append(row)
    return rows


def mainline_study(c: Ctx, budget_gib: int):
    """The tune_vs_fit study (in --mainline-db) of this budget at depth 0: of --mainline-series when given, else
    the newest confirmed one of any series; None when there is none."""
    import tune_vs_fit as tvf
    db = c.args.mainline_db
    if db is None or not db.exists():
        return None
    url = f"sqlite:///{db}"
    if c.args.mainline_series is not None:
        return load_study(url, tvf.cell_name(budget_gib, 0, c.args.mainline_series))
    import optuna
    from tuner.storage import make_storage
    first = tvf.cell_name(budget_gib, 0)
    found = [s for s in make_storage(url).get_all_studies()
             if (s.study_name == first or s.study_name.startswith(first + "-")) and StudyRecord.of(s).confirmed]
    if not found:
        return None
    newest = max(found, key=lambda s: StudyRecord.of(s).created)
    return optuna.load_study(study_name=newest.study_name, storage=url)


def mainline_rows(c: Ctx) -> list[dict[str, Any]]:
    """The tune_vs_fit cells of the same budgets at depth 0 (from --mainline-db), for the report."""
    import tune_vs_fit as tvf
    out = []
    for b in c.args.budgets:
        st = mainline_study(c, b)
        if st is not None:
            out.append(tvf.cell_row(st, b, 0))
    return out


@dataclass(frozen=True)
class Contender:
    key: str
    what: str
    measure: Callable[[], Any]


def ik_contenders(c: Ctx, b: int, wl: BenchRun) -> list[Contender]:
    """ik's --fit (its study baseline's line) and ik's confirmed best TG config at budget b."""
    st = load_study(c.args.storage, cell_name(b))
    if st is None:
        return []
    out = []
    fit = next((x for x in StudyRecord.of(st).baselines or [] if x.get("kind") == "engine-fit"), None)
    if fit is not None:
        out.append(Contender("ik-fit", "ik --fit (llama-sweep-bench)",
                             lambda: c.engine.measure_args(fit["argv"], wl, fit.get("env") or {})))
    plan = _best_plan(st)
    if plan is not None:
        out.append(Contender("ik-best", f"ik best TG ({plan.label})", lambda: c.engine.measure(c.inv, plan, wl)))
    return out


def _best_plan(study) -> Plan | None:
    key = ((StudyRecord.of(study).confirmed or {}).get("picks") or {}).get("best_tg")
    if not key or not key.startswith("trial:"):
        return None
    trial = next((t for t in study.get_trials(deepcopy=False) if t.number == int(key.split(":")[1])), None)
    return TrialRecord.from_trial(trial).plan() if trial is not None else None


def mainline_contenders(c: Ctx, ml: LlamaCppEngine, b: int, wl: BenchRun) -> list[Contender]:
    """mainline's --fit (own_fit the first time, its stored argv after: the same -fitt every round) and, from the
    tune_vs_fit study of the budget, mainline's confirmed best TG config."""
    argv_file = c.results / f"ml-{b}g-fit-argv.json"

    def fit() -> Any:
        if argv_file.exists():
            return ml.measure_args(json.loads(argv_file.read_text()), wl)
        f = ml.own_fit(c.inv, wl, {"CUDA0": b * GiB})
        if f is None:
            raise BadInput(f"{ml.path} has no -fitt: give a mainline llama-bench with --fit (PR #21304)")
        lg.write_json(argv_file, list(f.argv))
        return f.measurement
    out = [Contender("ml-fit", "mainline --fit (llama-bench -fitt)", fit)]
    st = mainline_study(c, b)
    plan = _best_plan(st) if st is not None else None
    if plan is not None:
        out.append(Contender("ml-best", f"mainline best TG of {st.study_name} ({plan.label})",
                             lambda: ml.measure(c.inv, plan, wl)))
    return out


def step_mainline(c: Ctx, ml: LlamaCppEngine) -> bool:
    wl = BenchRun(c.args.n_prompt, c.args.n_gen, 0, c.args.reps)
    for b in c.args.budgets:
        contenders = ik_contenders(c, b, wl) + mainline_contenders(c, ml, b, wl)
        for r in range(c.args.rounds):
            for ct in contenders:
                key = f"ml-{b}g-r{r}-{ct.key}"
                if c.done(key):
                    continue
                if not c.time_ok("mainline"):
                    return False
                m = ct.measure()
                log(f"mainline: {b} GiB round {r + 1}/{c.args.rounds} {ct.key}: "
                    f"{'ok' if m.ok else 'FAILED ' + m.error}; PP {m.pp_tps:.1f} TG {m.tg_tps:.2f}")
                c.keep(key, {"budget_gib": b, "round": r, "key": ct.key, "what": ct.what,
                             "measurement": m.to_dict()})
    return True


# ---- report ----------------------------------------------------------------------------------------------------------

def spread(values: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(values), "lo": min(values), "hi": max(values), "n": len(values)} \
        if values else None


def summarise(samples: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> list[dict[str, Any]]:
    """Per configuration (key(sample)), medians and [min-max] of PP, TG and VRAM over its ok samples, in
    first-seen order."""
    groups: dict[Any, list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(key(s), []).append(s)
    out = []
    for ss in groups.values():
        ok = [s["measurement"] for s in ss if s["measurement"]["ok"]]
        vram = [sum(m["peak_bytes"].values()) / MiB for m in ok if m.get("peak_bytes")]
        out.append({**{k: v for k, v in ss[0].items() if k not in ("measurement", "round")}, "samples": len(ss),
                    "failed": len(ss) - len(ok), "errors": sorted({s["measurement"]["error"] for s in ss
                                                                  if not s["measurement"]["ok"]})[:2],
                    "pp": spread([m["pp_tps"] for m in ok]), "tg": spread([m["tg_tps"] for m in ok]),
                    "vram_mib": spread(vram)})
    return out


def _cell(s: dict[str, float] | None, fmt: str = ".1f") -> str:
    return "-" if not s else f"{s['median']:{fmt}} [{s['lo']:{fmt}}-{s['hi']:{fmt}}]"


def memory_lines(plans: list[dict[str, Any]], title: str = "GPU memory: predicted vs measured (ik llama-sweep-bench)",
                 intro: str = "") -> list[str]:
    L = [f"## {title}", ""] + ([intro, ""] if intro else []) + [
         "| plan | ctx | ub | PP t/s | TG t/s | measured MiB | predicted MiB | error MiB | error % | goal MiB | ok | "
         "ik log: model+KV+compute MiB | model: weights+KV+compute+overhead+pool MiB |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for p in plans:
        m, c0, lgd, pr = p["measurement"], p["cuda0"], p.get("log"), p.get("predicted_parts")
        pp = f"{m['pp_tps']:.1f}" if m["ok"] else f"FAILED: {m['error'][:60]}"
        within = "-" if c0["within_goal"] is None else ("yes" if c0["within_goal"] else "**no**")
        pct = "-" if c0["error_pct"] is None else f"{c0['error_pct']:+.1f}"
        logged = "-" if not lgd else "+".join(lg._mib(lgd[x]) for x in ("model", "kv")) + \
            f"+{lg._mib(lgd['compute'] + lgd['output'])}"
        parts = "-" if not pr else "+".join(lg._mib(pr.get(x, 0)) for x in PARTS)
        L.append(f"| {p['name']} | {p['n_ctx']} | {p['knobs']['n_ubatch']} | {pp} | {m['tg_tps']:.2f} | "
                 f"{lg._mib(c0['measured_bytes'])} | {lg._mib(c0['predicted_bytes'])} | {lg._mib(c0['error_bytes'])} | "
                 f"{pct} | {lg._mib(c0['goal_bytes'])} | {within} | {logged} | {parts} |")
    judged = [p for p in plans if p["cuda0"]["within_goal"] is not None]
    over = [p["name"] for p in judged if not p["cuda0"]["within_goal"]]
    L += ["", f"{len(judged) - len(over)} of {len(judged)} measured plans within |error| <= max(3%, 256 MiB)"
          + (f"; over: {', '.join(over)}" if over else "") + ". error = predicted - measured; measured = peak "
          "device memory in use during the run minus the reading before it (CUDA context included). The log "
          "columns are for the device that ran (the CPU in a dry run); the model's parts are for the same run.", ""]
    L += ["Commands:", ""] + [f"- {p['name']}: `{p['command']}`" for p in plans] + [""]
    return L


def op_lines(rows: list[dict[str, Any]]) -> list[str]:
    L = ["## What -op buys: experts in RAM (-ngl 99 -ot exps=CPU), MoE op offload on / off", "",
         "| config | ub | PP t/s median [min-max] | PP x on | TG t/s median [min-max] | VRAM MiB | samples | command |",
         "|---|---:|---|---:|---|---:|---:|---|"]
    on = {r["n_ubatch"]: r for r in rows if r["name"].endswith("-on")}
    for r in rows:
        ref = on.get(r["n_ubatch"])
        x = f"{r['pp']['median'] / ref['pp']['median']:.2f}" if r["pp"] and ref and ref["pp"] else "-"
        vram = f"{r['vram_mib']['median']:.0f}" if r["vram_mib"] else "-"
        fails = f" ({r['failed']} failed: {'; '.join(e[:50] for e in r['errors'])})" if r["failed"] else ""
        L.append(f"| {r['name']} | {r['n_ubatch']} | {_cell(r['pp'])} | {x} | {_cell(r['tg'], '.2f')} | {vram} | "
                 f"{r['samples']}{fails} | `{r['command'].split(' -m ')[-1][:120]}` |")
    L += ["", "PP of llama-sweep-bench: one ubatch at depth 0, -nrep repeats inside a run; rounds interleave every "
          "configuration (A B C D .. A B C D ..). ik offloads MUL_MAT_ID / MOE_FUSED_UP_GATE only when "
          "batch x n_expert_used >= 32 x n_expert (Qwen3-30B-A3B: 128 experts, 8 used: ubatch >= 512).", ""]
    return L


def study_lines(rows: list[dict[str, Any]], ml_rows: list[dict[str, Any]]) -> list[str]:
    def c3(p: dict[str, Any] | None) -> str:
        return f"{p['tg']:.2f} / {p['pp']:.0f} / {p['vram_mib']:.0f}" if p else "-"

    def x(p: dict[str, Any] | None) -> str:
        v = (p or {}).get("tg_vs_fit")
        return f"{v['ratio']:.3f} {v['verdict']}" if v else "-"
    ml = {r["budget_gib"]: r for r in ml_rows}
    L = ["## ik tune study vs ik's own --fit (and the mainline study of the same budget)", "",
         "| budget | runs | ik --fit TG / PP / VRAM MiB | ik best TG | TG x ik fit | ik balanced | TG x | "
         "mainline --fit (tune_vs_fit) | mainline best TG | TG x mainline fit |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = ml.get(r["budget_gib"]) or {}
        L.append(f"| {r['budget_gib']} GiB | {r['runs']}{'' if r['confirmed'] else ' (unconfirmed)'} | "
                 f"{c3(r['fit'])} | {c3(r['best_tg'])} | {x(r['best_tg'])} | {c3(r['balanced'])} | "
                 f"{x(r['balanced'])} | {c3(m.get('fit'))} | {c3(m.get('best_tg'))} | {x(m.get('best_tg'))} |")
    L += ["", "Confirmed medians over interleaved re-runs; ik's PP is sweep-bench's (one ubatch), mainline's is "
          "llama-bench -p 2048: compare TG across engines, PP only within one.", ""]
    for r in rows:
        L.append(f"- {r['budget_gib']} GiB: ik --fit: {r.get('ik_fit_note') or '-'}"
                 + (f"; its choice `{r['ik_fit_chosen']}`" if r.get("ik_fit_chosen") else ""))
        for role in ("fit", "best_tg", "balanced"):
            if r.get(role):
                L.append(f"  - {role}: `{r[role]['flags']}`")
    return L + [""]


def mainline_lines(rows: list[dict[str, Any]]) -> list[str]:
    L = ["## Interleaved in one call: ik vs mainline at the same budget", "",
         "| budget | contender | TG t/s median [min-max] | TG x mainline --fit | PP t/s median [min-max] | "
         "VRAM MiB | samples |", "|---|---|---|---:|---|---:|---:|"]
    for b in sorted({r["budget_gib"] for r in rows}):
        sel = [r for r in rows if r["budget_gib"] == b]
        ref = next((r for r in sel if r["key"] == "ml-fit" and r["tg"]), None)
        for r in sel:
            x = f"{r['tg']['median'] / ref['tg']['median']:.3f}" if ref and r["tg"] else "-"
            vram = f"{r['vram_mib']['median']:.0f}" if r["vram_mib"] else "-"
            fails = f" ({r['failed']} failed: {'; '.join(e[:50] for e in r['errors'])})" if r["failed"] else ""
            L.append(f"| {b} GiB | {r['what']} | {_cell(r['tg'], '.2f')} | {x} | {_cell(r['pp'])} | {vram} | "
                     f"{r['samples']}{fails} |")
    L += ["", "TG is comparable across the engines (n_gen tokens at depth 0 in both). PP is not the same measure: "
          "llama-sweep-bench times one ubatch at depth 0, llama-bench times -p 2048 tokens in ubatches.", ""]
    return L


def report(c: Ctx, meta: dict[str, Any], out: Path) -> None:
    order = {n: i for i, n in enumerate(meta["case_order"])}
    plans = sorted(lg.load_results(c.results, "mem"), key=lambda p: order.get(p["name"], 1 << 30))
    mla_order = {n: i for i, n in enumerate(meta["mla_order"])}
    mla = sorted(lg.load_results(c.results, "mla"), key=lambda p: mla_order.get(p["name"], 1 << 30))
    op_order = {n: i for i, n in enumerate(meta["op_order"])}
    op = summarise(sorted(lg.load_results(c.results, "op"), key=lambda s: (op_order.get(s["name"], 99), s["round"])),
                   lambda s: s["name"])
    ml_samples = [s for s in lg.load_results(c.results, "ml") if "measurement" in s]   # not the stored -fitt argv
    ml = summarise(sorted(ml_samples, key=lambda s: (s["budget_gib"], s["round"])),
                   lambda s: (s["budget_gib"], s["key"]))
    rows, ml_rows = study_rows(c), mainline_rows(c)
    out.mkdir(parents=True, exist_ok=True)
    name = c.args.name
    lg.write_json(out / f"{name}.json", {"meta": meta, "memory": plans, "mla": mla, "op": op, "study": rows,
                                         "mainline_study": ml_rows, "mainline": ml})
    L = [f"# ik_llama.cpp on {meta.get('gpu') or 'no GPU (CPU dry run)'}", "",
         f"{meta['date']}; model {Path(meta['model']).name} ({meta['model_gib']:.2f} GiB, Q4_0, Qwen3-30B-A3B shape"
         f"{'' if plans or op or rows or ml else ', not run in these results'}); "
         f"ik {meta['binary']['version'] or meta['binary']['path']}; VRAM from {meta['vram_source']}; predictions: "
         f"planner.memory (dialect ik, hardware '{meta['hardware']}').", ""]
    if meta["cpu_mode"]:
        L += ["**CPU dry run**: every plan ran with all tensors on the CPU (ik's --fit dropped: a CPU build cannot "
              "fit); VRAM columns are empty.", ""]
    shape = "a tiny DeepSeek2" if meta["cpu_mode"] else f"{MLA_PRESET} shape: MLA, kv_lora 512, 64 experts / 6 used"
    mla_lines = memory_lines(
        mla, f"DeepSeek's MLA graphs: predicted vs measured ({Path(meta['mla_model']).name})",
        f"Model {Path(meta['mla_model']).name} ({meta['mla_model_gib']:.2f} GiB, Q4_0, {shape}).") if mla else []
    # a step with no results yet (not asked for, or not reached) leaves its section out
    L += (memory_lines(plans) if plans else []) + mla_lines + (op_lines(op) if op else [])
    L += study_lines(rows, ml_rows) if rows or ml_rows else []
    L += mainline_lines(ml) if ml else []
    (out / f"{name}.md").write_text("\n".join(L) + "\n")
    if rows:
        import tune_vs_fit as tvf
        try:              # its plot needs matplotlib; the numbers are in NAME.json/.md either way
            tvf.write_report(rows, {**meta, "n_prompt": c.args.n_prompt, "n_gen": c.args.n_gen, "reps": c.args.reps,
                                    "runs": c.args.runs, "confirm": c.args.confirm}, out, f"{name}_study")
        except ImportError as e:
            log(f"report: no {name}_study.png ({e})")
    opts.pack_state(c.results.parent, "ik_gpu.db", out / STATE_NAME)
    log(f"report: {out / name}.md ({len(plans)} memory plans, {len(mla)} MLA plans, {len(op)} op configs, "
        f"{len(rows)} study cells, {len(ml)} mainline contenders)")


# ---- predicting a stored report again --------------------------------------------------------------------------------

def synthetic_inventory(source: str = "", preset: str = lg.PRESET) -> ModelInventory:
    """The inventory of the model write_model writes (no file needed): the preset's shape, uniform Q4_0."""
    from planner.archs import build_inventory
    from planner.presets import load_preset
    from runtime.synth import uniform_recipe
    return build_inventory(load_preset(preset).spec, uniform_recipe(lg.QUANT),
                           name=f"synthetic-{preset.split(':')[0]}-{lg.QUANT}", source=source)


def repredict(stored: dict[str, Any], inv: ModelInventory, hw: HardwareProfile, key: str = "memory"
              ) -> list[dict[str, Any]]:
    """Every measured plan of a stored GPU report's `key` table ("memory", or "mla" with the MLA model's
    inventory) predicted again by today's planner.memory, from the GPU command it recorded (its -c is the context
    the run held): no engine, no GPU."""
    from planner.flags import parse
    out = []
    for rec in stored.get(key, []):
        measured = rec["cuda0"]["measured_bytes"]
        if measured is None or not rec["command"]:
            continue
        plan = parse(rec["command"], inv, "ik").to_plan(str(inv.source), rec["name"])
        now = estimate(inv, plan, hw).to_dict()["devices"].get("CUDA0", {"total": 0})
        out.append({"name": rec["name"], "n_ubatch": rec["knobs"]["n_ubatch"], "measured_bytes": measured,
                    "stored_predicted_bytes": rec["cuda0"]["predicted_bytes"],
                    "stored_error_bytes": rec["cuda0"]["error_bytes"], "log": rec.get("log"),
                    "predicted_parts": now, "cuda0": lg.compare(now, measured)})
    return out


def repredict_lines(rows: list[dict[str, Any]], source: str, hw_name: str, what: str = "memory plans") -> list[str]:
    L = [f"# {source}: the {what} predicted again", "",
         f"planner.memory (dialect ik, hardware '{hw_name}') today, from each plan's recorded GPU command; measured "
         "and stored columns as the report has them.", "",
         "| plan | ub | measured MiB | stored predicted | stored error | predicted now | error now | ok | "
         "ik log: model+KV+compute MiB | now: weights+KV+compute+overhead+pool MiB |",
         "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        c0, lgd, pr = r["cuda0"], r["log"], r["predicted_parts"]
        logged = "-" if not lgd else "+".join(lg._mib(lgd[x]) for x in ("model", "kv")) + \
            f"+{lg._mib(lgd['compute'] + lgd['output'])}"
        L.append(f"| {r['name']} | {r['n_ubatch']} | {lg._mib(r['measured_bytes'])} | "
                 f"{lg._mib(r['stored_predicted_bytes'])} | {lg._mib(r['stored_error_bytes'])} | "
                 f"{lg._mib(c0['predicted_bytes'])} | {lg._mib(c0['error_bytes'])} | "
                 f"{'yes' if c0['within_goal'] else '**no**'} | {logged} | "
                 f"{'+'.join(lg._mib(pr.get(x, 0)) for x in PARTS)} |")
    over = [r["name"] for r in rows if not r["cuda0"]["within_goal"]]
    L += ["", f"{len(rows) - len(over)} of {len(rows)} plans within |error| <= max(3%, 256 MiB)"
          + (f"; over: {', '.join(over)}" if over else "") + "; error = predicted - measured.", ""]
    return L


def run_repredict(args: argparse.Namespace) -> int:
    path = args.repredict
    if not path.is_file():
        raise BadInput(f"--repredict {path}: no such file")
    stored = json.loads(path.read_text())
    if stored.get("meta", {}).get("cpu_mode"):
        raise BadInput(f"--repredict {path}: a CPU dry run has no measured VRAM to predict")
    model = args.model or Path(stored.get("meta", {}).get("model", ""))
    inv = load_inventory(model) if model.is_file() else synthetic_inventory(str(model))
    hw = load_hardware(args.hardware)
    rows = repredict(stored, inv, hw)
    mla_rows = []
    if stored.get("mla"):
        mla_model = Path(stored["meta"].get("mla_model", ""))
        mla_inv = load_inventory(mla_model) if mla_model.is_file() else synthetic_inventory(str(mla_model),
                                                                                            MLA_PRESET)
        mla_rows = repredict(stored, mla_inv, hw, "mla")
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else path.parent)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{path.stem}_repredict"
    lg.write_json(out / f"{name}.json", {"source": str(path), "hardware": hw.name, "memory": rows, "mla": mla_rows})
    lines = repredict_lines(rows, path.name, hw.name) if rows or not mla_rows else []   # an MLA-only report: its own
    lines += repredict_lines(mla_rows, path.name, hw.name, "MLA plans") if mla_rows else []
    text = "\n".join(lines) + "\n"
    (out / f"{name}.md").write_text(text)
    print(text, end="")
    return 0


# ---- main ------------------------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    opts.add_call_options(ap, name="ik_gpu", workdir=DEFAULT_WORKDIR, time_budget=520.0, min_left=60.0,
                          timeout=240.0, cpu_help="the CPU ik build, a tiny model, every plan all-CPU",
                          min_left_help="a new run needs (a study cell's baselines need about 2 of them)")
    ap.add_argument("--ik-bin", type=Path, help=f"folder with ik's llama-sweep-bench (default {IK_BIN})")
    ap.add_argument("--mainline-bench", type=Path, help="mainline llama-bench with -fitt for the mainline step "
                    f"(default {MAINLINE_BENCH} when it exists; --cpu: the CPU build)")
    ap.add_argument("--mainline-db", type=Path, help=f"tune_vs_fit's SQLite db (default {MAINLINE_DB} when there)")
    ap.add_argument("--mainline-series", help="the tune_vs_fit --series whose studies to read ('' the first one; "
                    "default: the newest confirmed study of each budget)")
    ap.add_argument("--model", type=Path, help=f"default {MODEL} (written if missing)")
    ap.add_argument("--mla-model", type=Path, help=f"the mla step's DeepSeek-shaped model (default {MLA_MODEL}, "
                    "written if missing)")
    opts.add_step_options(ap, STEPS, plans="memory and mla plans", listed="memory, mla and op plans")
    ap.add_argument("--budgets", help="GiB, comma list (default 8,16; 1 with --cpu)")
    opts.add_study_options(ap, DEFAULTS)
    ap.add_argument("--rounds", type=int, help="op and mainline: interleaved rounds "
                    f"({opts.default_text(DEFAULTS, 'rounds')})")
    opts.add_workload_options(ap, DEFAULTS, what="study and mainline runs")
    ap.add_argument("--mem-gen", type=int, default=16, help="memory: tokens generated per run (default 16)")
    ap.add_argument("--op-gen", type=int, default=16, help="op: tokens generated per run (default 16)")
    ap.add_argument("--model-min-left", type=float, default=200.0, help="seconds the 17 GB model write needs")
    ap.add_argument("--repredict", type=Path, metavar="REPORT.json", help="no runs: predict the memory plans of a "
                    "stored GPU report again with today's memory model; writes REPORT_repredict.{md,json} to --out "
                    "(default: beside it)")
    args = opts.resolve(ap, ap.parse_args(argv), DEFAULTS)
    args.steps = opts.parse_steps(ap, args.steps, STEPS)
    args.budgets = opts.parse_budgets(ap, args.budgets or ("1" if args.cpu else "8,16"))
    args.plans = [p for p in args.plans.split(",") if p]
    return args


def binaries(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """ik's llama-sweep-bench and the mainline llama-bench (None: no mainline step)."""
    if args.cpu:
        from runtime.ik_build import ensure_built
        sweep = (args.ik_bin / "llama-sweep-bench") if args.ik_bin else ensure_built()["llama-sweep-bench"]
        if args.mainline_bench is None and "mainline" in args.steps:
            from runtime.llamacpp_build import ensure_built as ensure_mainline
            return sweep, ensure_mainline()["llama-bench"]
        return sweep, args.mainline_bench
    sweep = (args.ik_bin or IK_BIN) / "llama-sweep-bench"
    if not sweep.is_file():
        raise BadInput(f"no llama-sweep-bench at {sweep}: run `bash benchmarks/llamacpp_gpu.sh build-ik` or give "
                       "--ik-bin")
    if args.mainline_bench is None:          # the mainline CUDA build of `llamacpp_gpu.sh build`, when there
        return sweep, MAINLINE_BENCH if MAINLINE_BENCH.is_file() else None
    if not args.mainline_bench.is_file():
        raise BadInput(f"--mainline-bench {args.mainline_bench}: no such file")
    return sweep, args.mainline_bench


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_repredict(args) if args.repredict else run(args)
    except (BadInput, InputError) as e:
        print(f"ik_gpu: error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    workdir = args.workdir or (DEFAULT_WORKDIR / "cpu" if args.cpu else DEFAULT_WORKDIR)
    workdir.mkdir(parents=True, exist_ok=True)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else workdir / "report")
    results = workdir / "results"
    results.mkdir(parents=True, exist_ok=True)
    args.storage = f"sqlite:///{workdir / 'ik_gpu.db'}"
    if args.mainline_db is None and MAINLINE_DB.exists() and not args.cpu:
        args.mainline_db = MAINLINE_DB
    model = args.model or (workdir / "tiny-qwen3moe-q4_0.gguf" if args.cpu else MODEL)
    if not model.exists():
        if args.model is not None:
            raise BadInput(f"--model {model}: no such file")
        if not args.cpu and args.time_budget - (time.monotonic() - t0) < args.model_min_left:
            log(f"model: not written in this call (writing 17 GB needs ~{args.model_min_left:.0f} s); run again")
            return 3
        lg.write_model(model, args.cpu)
    inv = load_inventory(model)
    mla_model = args.mla_model or (workdir / "tiny-deepseek2-q4_0.gguf" if args.cpu else MLA_MODEL)
    if "mla" in args.steps and not mla_model.exists():
        if args.mla_model is not None:
            raise BadInput(f"--mla-model {mla_model}: no such file")
        lg.write_model(mla_model, args.cpu, MLA_PRESET, TINY_DEEPSEEK)
    mla_inv = load_inventory(mla_model) if mla_model.exists() else None
    hw = load_hardware(args.hardware)
    if args.cpu:      # the stand-in runs on this machine's cores: plans with gpu-box's 16 threads crawl on 2
        hw = replace(hw, host=replace(hw.host, n_threads=min(hw.host.n_threads, os.cpu_count() or 1)))
    long_ctx = 1024 if args.cpu else LONG_CTX
    cases, ops = make_cases(inv, hw, args.budgets, args.n_prompt, long_ctx), op_cases(inv)
    mlas = mla_cases(mla_inv, args.n_prompt, long_ctx) if mla_inv is not None else []
    if args.list:
        for x in cases + mlas + ops:
            print(f"{x.name:28s} {x.what}")
        return 0
    unknown = [p for p in args.plans if p not in {x.name for x in cases + mlas}]
    if unknown:
        raise BadInput(f"unknown plan {unknown[0]!r}; --list shows them")
    sweep, ml_bench = binaries(args)
    engine = LlamaCppEngine(sweep, timeout_s=args.timeout, model_path=model, verbose=True, cpu_stand_in=args.cpu)
    if engine.info.dialect != "ik" or engine.info.tool != "sweep":
        raise BadInput(f"{sweep} is not ik's llama-sweep-bench ({engine.info.dialect} {engine.info.tool})")
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu_mode": args.cpu, "binary": engine.info.to_dict(), "gpu": _gpu_name(engine),
            "vram_source": engine.sampler().source if engine.sampler() else "none", "model": str(model),
            "model_gib": model.stat().st_size / GiB, "hardware": hw.name, "budgets": args.budgets,
            "case_order": [x.name for x in cases], "op_order": [x.name for x in ops], "goal": "max(3%, 256 MiB)",
            "mla_model": str(mla_model), "mla_model_gib": mla_model.stat().st_size / GiB if mla_inv else 0.0,
            "mla_order": [x.name for x in mlas],
            "mainline_bench": str(ml_bench) if ml_bench else None,
            "mainline_db": str(args.mainline_db) if args.mainline_db else None}
    c = Ctx(args, engine, inv, hw, results, t0 + args.time_budget, lambda: None)
    c.after_each = lambda: report(c, meta, out)    # after every result: a call cut off still leaves a report
    mla_c = None
    if mla_inv is not None:    # the same steps' machinery on the MLA model: its own engine (-m) and inventory
        mla_c = replace(c, inv=mla_inv, engine=LlamaCppEngine(sweep, timeout_s=args.timeout, model_path=mla_model,
                                                              verbose=True, cpu_stand_in=args.cpu))
    done = _run_steps(c, cases, ops, ml_bench, mla_c, mlas)
    report(c, meta, out)
    log("all steps done" if done else "work left: run again")
    return 0 if done else 3


def _run_steps(c: Ctx, cases: list[IkCase], ops: list[IkCase], ml_bench: Path | None, mla_c: Ctx | None,
               mlas: list[IkCase]) -> bool:
    steps = c.args.steps
    if "memory" in steps and not step_memory(c, cases):
        return False
    if "mla" in steps and mla_c is not None and not step_memory(mla_c, mlas, "mla", "mla"):
        return False
    if "op" in steps and not step_op(c, ops):
        return False
    if "study" in steps and not step_study(c):
        return False
    if "mainline" in steps and ml_bench is None:
        log("mainline: skipped (no --mainline-bench)")
    if "mainline" in steps and ml_bench is not None:
        ml = LlamaCppEngine(ml_bench, timeout_s=c.args.timeout, model_path=c.engine.model_path,
                            cpu_stand_in=c.args.cpu)
        if ml.info.dialect != "mainline":
            raise BadInput(f"--mainline-bench {ml_bench} is an {ml.info.dialect} build, not mainline")
        return step_mainline(c, ml)
    return True


def _gpu_name(engine: LlamaCppEngine) -> str | None:
    """The GPU's name from nvidia-smi (ik's sweep-bench cannot list devices)."""
    import shutil
    import subprocess
    if engine.sampler() is None or not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                       text=True)
    return r.stdout.strip().replace("\n", "; ") or None if r.returncode == 0 else None


if __name__ == "__main__":
    sys.exit(main())
