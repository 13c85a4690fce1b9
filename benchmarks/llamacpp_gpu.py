"""GPU benchmark of the llamacpp engine and of the memory model (issue 4): a synthetic Qwen3-30B-A3B-shaped
Q4_0 model (~17 GB) on one GPU, >= 12 hand-made plans, the planner's own plan at each budget, and llama.cpp's
`--fit` (llama-bench -fitt) at 4/8/12/16 GiB; PP, TG, peak VRAM sampled during each run, and the VRAM that
planner.memory predicts for the same run (HardwareProfile "gpu-box").

Writes llamacpp_gpu.json and llamacpp_gpu.md to --out (default $OUT, else <workdir>/report): per plan the
predicted vs measured peak VRAM and |error| against the goal max(3%, 256 MiB); per budget --fit's PP/TG/VRAM
beside the best plan of the run at or under that budget; the matcher check (the planner's -ot matcher and -ngl
slots against the loader's own -v lines, CUDA0 and CPU mixed).

Resumable in pieces (each device command may run 10 minutes): the model is written once (skipped when the
file exists), each plan's result is kept under <workdir>/results/ and skipped on the next call (--redo runs it
again), and a call stops starting new plans after --time-budget seconds. Every call rewrites the report from
all results so far.

On the GPU machine (from the repo root; what must be carried: see benchmarks/llamacpp_gpu.sh), one device
command each, the next one at once (the machine, and with it the build, the model and the results, goes back
when idle):
    bash benchmarks/llamacpp_gpu.sh all build/llama.cpp-src.tar.gz      # build (~6 min), model, matcher, ...
    bash benchmarks/llamacpp_gpu.sh run                                  # repeat until it exits 0 ("all ... done")
Exit code 3: stopped by --time-budget with work left; 0: everything measured.
Here, without a GPU, the whole pipeline on the CPU build and a tiny model (every plan measured all-CPU):
    .venv/bin/python benchmarks/llamacpp_gpu.py --cpu
Needs only numpy from outside the repository (no gguf package); nvidia-ml-py or nvidia-smi for VRAM.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
from planner.flags import parse, render  # noqa: E402
from planner.gguf_header import load_inventory  # noqa: E402
from planner.hardware import GiB, MiB, HardwareProfile, load_hardware  # noqa: E402
from planner.model import ModelInventory, Tensor  # noqa: E402
from planner.plan import Knobs, OffloadPolicy, Plan  # noqa: E402
from planner.engine_contract import BenchRun  # noqa: E402
from runtime.cost_check import run_line  # noqa: E402
from runtime.llamacpp import LlamaCppEngine, bench_memory, loader_placement  # noqa: E402
from runtime.process import run_process  # noqa: E402

PRESET = "Qwen3-30B-A3B:Q8_0"          # shape only: the file is written with a uniform Q4_0 recipe
QUANT = "Q4_0"
GOAL_FRACTION, GOAL_FLOOR = 0.03, 256 * MiB
DEFAULT_WORKDIR = ROOT / "benchmarks" / "results" / "llamacpp_gpu"
STEPS = ("model", "matcher", "plans", "fit", "report")
DEFAULTS: opts.Defaults = {"n_prompt": (2048, 32), "n_gen": (64, 4), "reps": (3, 1)}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the model -------------------------------------------------------------------------------------------------------

TINY_QWEN3 = {"arch": "qwen3moe", "n_layer": 8, "n_expert": 16, "n_expert_used": 4}


def write_model(path: Path, tiny: bool, preset: str = PRESET, tiny_spec_args: dict[str, Any] | None = None,
                vocab: bool = False) -> None:
    """The synthetic model (the preset's shape, or with `tiny` runtime.synth.tiny_spec(**tiny_spec_args), default
    a small Qwen3 MoE), uniform Q4_0, written to a temporary name and renamed (a cut-off write is never mistaken
    for one). `vocab`: with a made-up vocabulary (llama-server prints tokens as text; runtime.synth.spm_vocab)."""
    from runtime.synth import tiny_spec, uniform_recipe, write_gguf
    if path.exists():
        log(f"model: {path} exists ({path.stat().st_size / GiB:.2f} GiB), not rewritten")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    if tiny:
        spec = tiny_spec(**(tiny_spec_args or TINY_QWEN3))
    else:
        from planner.presets import load_preset
        spec = load_preset(preset).spec
    done = [0, 0.0]
    t0 = time.monotonic()

    def progress(n: int) -> None:
        done[0] += n
        if done[0] - done[1] >= 2 * GiB:
            done[1] = done[0]
            log(f"model: {done[0] / GiB:.1f} GiB written ({done[0] / GiB / (time.monotonic() - t0):.2f} GiB/s)")

    shape = f"tiny-{spec.hparams.arch}" if tiny else preset.split(":")[0]
    write_gguf(tmp, spec, uniform_recipe(QUANT), name=f"synthetic-{shape}-{QUANT}", progress=progress, vocab=vocab)
    os.replace(tmp, path)
    log(f"model: wrote {path} ({path.stat().st_size / GiB:.2f} GiB) in {time.monotonic() - t0:.0f} s")


# ---- the plans -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    name: str
    what: str
    plan: Plan


def placement(inv: ModelInventory, on_gpu: Callable[[Tensor], bool], gpu: str = "CUDA0") -> dict[str, str]:
    """token_embd on the CPU (llama.cpp keeps the input layer there), every other tensor where on_gpu says."""
    return {t.name: (gpu if t.role != "token_embd" and on_gpu(t) else "CPU") for t in inv.allocated()}


def make_cases(inv: ModelInventory, hw: HardwareProfile, budgets: list[int], n_prompt: int) -> list[Case]:
    moe = inv.moe_layers()
    n_layer = inv.hparams.n_layer
    k40 = max(1, round(0.4 * len(moe)))
    first, last = set(moe[:k40]), set(moe[-k40:])
    quarter, next_half = set(moe[: len(moe) // 4]), set(moe[len(moe) // 4: 3 * len(moe) // 4])
    base = Knobs(n_ctx=n_prompt, n_batch=2048, n_ubatch=512)
    ub2048 = replace(base, n_batch=max(2048, n_prompt), n_ubatch=2048)
    ub2048_b4096 = replace(base, n_batch=4096, n_ubatch=2048)
    nopo = OffloadPolicy.all(False)

    def dense(t: Tensor) -> bool:
        return not t.is_expert

    def experts(pred: Callable[[Tensor], bool]) -> Callable[[Tensor], bool]:
        return lambda t: dense(t) or pred(t)

    whole = n_layer // 2
    cases = [
        Case("all-gpu", "every tensor but token_embd on the GPU", Plan("m", placement(inv, lambda t: True), base)),
        Case(f"layers-last{whole}", f"whole layers: output + the last {whole} blocks (what -ngl {whole + 1} does)",
             Plan("m", placement(inv, lambda t: t.layer is None or t.layer >= n_layer - whole), base)),
        Case("attn-only", "attention/norms/router on the GPU, every expert in RAM (-cmoe), op offload on",
             Plan("m", placement(inv, dense), base)),
        Case("attn-only-nopo", "as attn-only, op offload off (-nopo 1)",
             Plan("m", placement(inv, dense), replace(base, offload=nopo))),
        Case(f"exps-first{k40}", f"attn + experts of the first {k40} MoE layers on the GPU",
             Plan("m", placement(inv, experts(lambda t: t.layer in first)), base)),
        Case(f"exps-last{k40}", f"attn + experts of the last {k40} MoE layers on the GPU",
             Plan("m", placement(inv, experts(lambda t: t.layer in last)), base)),
        Case("up-gate-all", "attn + ffn_up/ffn_gate experts of every layer on the GPU, ffn_down in RAM",
             Plan("m", placement(inv, experts(lambda t: t.role in ("exps_up", "exps_gate"))), base)),
        Case("down-all", "attn + ffn_down experts of every layer on the GPU, up/gate in RAM",
             Plan("m", placement(inv, experts(lambda t: t.role == "exps_down")), base)),
        Case("mixed-partial", "attn + all experts of the first quarter of the MoE layers, ffn_up only of the next "
             "half, none of the last quarter",
             Plan("m", placement(inv, experts(lambda t: t.layer in quarter
                                              or (t.layer in next_half and t.role == "exps_up"))), base)),
        Case(f"exps-first{k40}-ub2048", f"as exps-first{k40}, -ub 2048 -b {ub2048.n_batch}",
             Plan("m", placement(inv, experts(lambda t: t.layer in first)), ub2048)),
        Case("attn-only-ub2048", "as attn-only, -ub 2048 -b 4096", Plan("m", placement(inv, dense), ub2048_b4096)),
        Case("attn-only-ub2048-nopo", "as attn-only, -ub 2048 -b 4096, op offload off",
             Plan("m", placement(inv, dense), replace(ub2048_b4096, offload=nopo))),
        Case("all-gpu-ub2048", "every tensor on the GPU, -ub 2048", Plan("m", placement(inv, lambda t: True), ub2048)),
    ]
    from planner.errors import BudgetError
    from planner.propose import best_plans
    for b in budgets:
        try:
            best = best_plans(inv, hw.with_vram([b * GiB]), base, "mainline", "tg", GOAL_FLOOR, n_prompt)[0]
        except BudgetError as e:
            log(f"plans: no planner plan at {b} GiB: {e}")
            continue
        cases.append(Case(f"planner-{b}G", f"offload-tuner plan's best TG plan for {b} GiB ({best.plan.label})",
                          best.plan))
    return [replace(c, plan=replace(c.plan, model_id=inv.source, label=c.name)) for c in cases]


def cpu_variant(plan: Plan) -> Plan:
    """--cpu mode: the same knobs with every tensor on the CPU (a CPU build rejects CUDA0)."""
    return replace(plan, assignment={n: "CPU" for n in plan.assignment})


# ---- measuring -------------------------------------------------------------------------------------------------------

def goal(predicted: int) -> int:
    return max(int(GOAL_FRACTION * predicted), GOAL_FLOOR)


def log_device(m_raw: dict[str, Any], device: str = "CUDA0") -> dict[str, int] | None:
    """What the -v log says llama.cpp allocated on a device: model, and KV + compute + output of the larger
    context (benchmarks/ik_gpu.py reads the CPU's in its dry run)."""
    lm = m_raw.get("log_memory")
    if not lm:
        return None
    ctxs = [{"kv": c["kv"].get(device, 0), "compute": c["compute"].get(device, 0),
             "output": c["output"].get(device, 0)} for c in lm["contexts"]]
    big = max(ctxs, key=lambda c: sum(c.values()), default={"kv": 0, "compute": 0, "output": 0})
    return {"model": lm["model"].get(device, 0), **big}


def log_cuda0(m_raw: dict[str, Any]) -> dict[str, int] | None:
    return log_device(m_raw, "CUDA0")


def compare(predicted: dict[str, Any], measured: int | None) -> dict[str, Any]:
    total = predicted["total"]
    if measured is None:
        return {"predicted_bytes": total, "measured_bytes": None, "error_bytes": None, "error_pct": None,
                "goal_bytes": goal(total), "within_goal": None}
    err = total - measured
    return {"predicted_bytes": total, "measured_bytes": measured, "error_bytes": err,
            "error_pct": 100.0 * err / measured if measured else None, "goal_bytes": goal(total),
            "within_goal": abs(err) <= goal(total)}


def measure_case(engine: LlamaCppEngine, inv: ModelInventory, case: Case, wl: BenchRun, hw: HardwareProfile,
                 cpu: bool) -> dict[str, Any]:
    run_plan = cpu_variant(case.plan) if cpu else case.plan
    gpu_cmd = render(case.plan, inv, "bench", bench=wl, model_path=str(inv.source)).shell(str(engine.path))
    pred = bench_memory(inv, case.plan, wl, hw).to_dict()["devices"]
    t0 = time.monotonic()
    m = engine.measure(inv, run_plan, wl)
    measured = None if cpu else m.peak_bytes.get("CUDA0")
    rec = {
        "name": case.name, "what": case.what, "plan_id": case.plan.id, "plan": case.plan.to_dict(),
        "knobs": {"n_ubatch": case.plan.knobs.n_ubatch, "n_batch": case.plan.knobs.n_batch,
                  "op_offload": case.plan.knobs.offload.any_enabled, "mmap": case.plan.knobs.mmap},
        "gpu_bytes_weights": sum(t.nbytes for t in inv.allocated() if case.plan.assignment[t.name] != "CPU"),
        "command": gpu_cmd, "ran": m.raw.get("command"), "cpu_mode": cpu, "seconds": round(time.monotonic() - t0, 1),
        "measurement": m.to_dict(), "predicted": pred,
        "cuda0": compare(pred.get("CUDA0", {"total": 0}), measured), "log_cuda0": log_cuda0(m.raw),
    }
    return rec


def time_left(args, t_start: float) -> float:
    return args.time_budget - (time.monotonic() - t_start)


def run_plans(args, engine: LlamaCppEngine, inv: ModelInventory, hw: HardwareProfile, cases: list[Case],
              wl: BenchRun, results_dir: Path, t_start: float, after_each: Callable[[], None]) -> bool:
    """Measure the cases not measured yet; False when the time budget stopped it early."""
    results_dir.mkdir(parents=True, exist_ok=True)
    wanted = [c for c in cases if not args.plans or c.name in args.plans]
    for i, case in enumerate(wanted):
        out = results_dir / f"plan-{case.name}.json"
        if out.exists() and not args.redo:
            continue
        left = time_left(args, t_start)
        if left < args.min_left:
            log(f"plans: stopping, {left:.0f} s left of --time-budget; run again to continue")
            return False
        log(f"plans: [{i + 1}/{len(wanted)}] {case.name}: {case.what}")
        rec = measure_case(engine, inv, case, wl, hw, args.cpu)
        m = rec["measurement"]
        c0 = rec["cuda0"]
        log(f"plans: {case.name}: {'ok' if m['ok'] else 'FAILED ' + m['error']}; PP {m['pp_tps']:.1f} TG "
            f"{m['tg_tps']:.2f} t/s; VRAM measured {_mib(c0['measured_bytes'])} predicted {_mib(c0['predicted_bytes'])}"
            f" ({rec['seconds']} s)")
        write_json(out, rec)
        after_each()
    log(f"plans: all {len(wanted)} plans done")
    return True


# ---- llama.cpp's own --fit -------------------------------------------------------------------------------------------

def run_fit(args, engine: LlamaCppEngine, fit_params: Path, inv: ModelInventory, hw: HardwareProfile,
            wl: BenchRun, results_dir: Path, t_start: float, after_each: Callable[[], None]) -> bool:
    """llama-bench -fitt at each budget not measured yet; False when the time budget stopped it early."""
    sampler = engine.sampler()
    for b in args.budgets:
        out = results_dir / f"fit-{b}G.json"
        if out.exists() and not args.redo:
            continue
        if time_left(args, t_start) < args.min_left:
            log("fit: stopping, --time-budget nearly spent; run again to continue")
            return False
        free = sampler.free().get(0) if sampler is not None else None
        # -fitt is the free memory llama.cpp must leave: what is free now minus the budget (0 would mean "off")
        margin_mib = max((free - b * GiB) // MiB, 1) if free is not None else 1024
        common = ["-ub", "512", "-b", "2048"]
        log(f"fit: {b} GiB budget: -fitt {margin_mib} (free {_mib(free)})")
        m = engine.measure_args(["-m", str(inv.source), "-p", str(wl.n_prompt), "-n", str(wl.n_gen), "-r",
                                 str(wl.repetitions), "-fa", "1", "-fitt", str(margin_mib), *common], wl)
        chosen, predicted = _fit_choice(fit_params, inv, hw, wl, margin_mib)
        rec = {"budget_gib": b, "fitt_mib": margin_mib, "free_bytes": free, "measurement": m.to_dict(),
               "measured_bytes": None if args.cpu else m.peak_bytes.get("CUDA0"), "fit_params_flags": chosen,
               "predicted_for_choice": predicted, "log_cuda0": log_cuda0(m.raw)}
        log(f"fit: {b} GiB: {'ok' if m.ok else 'FAILED ' + m.error}; PP {m.pp_tps:.1f} TG {m.tg_tps:.2f}; VRAM "
            f"{_mib(rec['measured_bytes'])}; llama-fit-params: {chosen}")
        write_json(out, rec)
        after_each()
    return True


def _fit_choice(fit_params: Path, inv: ModelInventory, hw: HardwareProfile, wl: BenchRun, margin_mib: int
                ) -> tuple[str | None, dict[str, Any] | None]:
    """What llama-fit-params picks for the prompt test's context (llama-bench fits each test's context on its
    own) and what our memory model predicts for that choice."""
    argv = [str(fit_params), "-m", str(inv.source), "-c", str(wl.n_prompt + wl.depth), "-fitt", str(margin_mib),
            "-ub", "512", "-b", "2048", "-fa", "on", "-np", "1"]
    run = run_process(argv, None, 600)
    line = next((ln.strip() for ln in run.stdout.splitlines() if ln.startswith("-c ")), None)
    if run.returncode != 0 or line is None:
        return None, None
    try:
        pc = parse(line, inv, "mainline", tool="server")
    except Exception as e:          # report, do not stop the benchmark
        return line, {"error": str(e)}
    plan = Plan(inv.source, pc.assignment, replace(pc.knobs, n_ubatch=512, n_batch=2048), "mainline", "fit")
    return line, bench_memory(inv, plan, wl, hw).to_dict()["devices"]


# ---- the matcher against the loader, with a GPU ----------------------------------------------------------------------

MATCHER_CASES = [
    ["-ngl", "0", "-ot", r"blk\.1\.ffn_(up|gate)_exps=CUDA0;blk\.1\.=CPU;exps=CUDA0;^output=CUDA0"],
    ["-ngl", "1"],
    ["-ngl", "3", "-ot", r"attn_(q|k)\.=CPU"],
    ["-ngl", "99", "-ot", r"blk\.[0-3]\.ffn_down=CPU", "-ncmoe", "2"],
    ["-ngl", "99", "-ot", r"norm\.weight$=CPU;blk\.(2|5)\.=CPU"],
]


def run_matcher(bench: Path, tiny_model: Path, cpu: bool) -> list[dict[str, Any]]:
    """The planner's placement of a command line (matcher + -ngl slots) against where the loader put each tensor."""
    inv = load_inventory(tiny_model)
    out = []
    for args in MATCHER_CASES:
        if cpu:
            args = [a.replace("CUDA0", "CPU") for a in args]
        pc = parse(["-t", "4", *args], inv, "mainline", tool="bench", n_gpus=0 if cpu else 1)
        try:
            lp = loader_placement(bench, tiny_model, ["-t", "4", *args])
        except RuntimeError as e:
            out.append({"args": args, "ok": False, "error": str(e)})
            continue
        theirs = {}
        for t in inv.allocated():
            slot = inv.hparams.n_layer if t.layer is None and t.role != "token_embd" else t.layer
            theirs[t.name] = lp.overridden.get(t.name) or (lp.layer_devices.get(slot, "CPU") if slot is not None
                                                           else "CPU")
        ours = dict(pc.assignment)
        if cpu:                                   # a CPU build puts every slot on the CPU whatever -ngl says
            ours = {n: "CPU" for n in ours}
        diff = sorted(n for n in ours if ours[n] != theirs.get(n))
        out.append({"args": args, "ok": not diff, "n_tensors": len(ours), "n_overridden": len(lp.overridden),
                    "mismatches": [{"tensor": n, "ours": ours[n], "llama.cpp": theirs.get(n)} for n in diff[:20]]})
        log(f"matcher: {' '.join(args)}: {'agrees' if not diff else f'{len(diff)} tensors differ, e.g. {diff[0]}'}")
    return out


# ---- report ----------------------------------------------------------------------------------------------------------

def _mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:,.0f}"


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def load_results(results_dir: Path, prefix: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(results_dir.glob(f"{prefix}-*.json"))]


def best_under(plans: list[dict[str, Any]], budget_bytes: int, key: str) -> dict[str, Any] | None:
    ok = [p for p in plans if p["measurement"]["ok"] and p["cuda0"]["measured_bytes"] is not None
          and p["cuda0"]["measured_bytes"] <= budget_bytes]
    return max(ok, key=lambda p: p["measurement"][key], default=None)


def report(meta: dict[str, Any], plans: list[dict[str, Any]], fits: list[dict[str, Any]],
           matcher: list[dict[str, Any]] | None, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    order = {name: i for i, name in enumerate(meta.get("case_order", []))}
    plans = sorted(plans, key=lambda p: order.get(p["name"], 1 << 30))
    fits = sorted(fits, key=lambda f: f["budget_gib"])
    write_json(out_dir / "llamacpp_gpu.json", {"meta": meta, "plans": plans, "fit": fits, "matcher": matcher})
    lines = [f"# llamacpp engine on {meta.get('gpu') or 'no GPU (CPU dry run)'}: predicted vs measured VRAM",
             "", f"{meta['date']}; model {meta['model']} ({meta['model_gib']:.2f} GiB, {QUANT}); workload "
             f"-p {meta['workload']['n_prompt']} -n {meta['workload']['n_gen']} -r {meta['workload']['repetitions']}; "
             f"binary {meta['binary']['path']} ({meta['binary']['dialect']}, -ngl rule {meta['binary']['ngl_rule']}); "
             f"VRAM from {meta.get('vram_source')}; prediction: planner.memory with hardware '{meta['hardware']}' "
             "(CUDA context overhead included), max over llama-bench's pp and tg contexts.", ""]
    if meta.get("cpu_mode"):
        lines += ["**CPU dry run**: every plan ran with all tensors on the CPU; VRAM columns are empty.", ""]
    lines += ["## Plans", "",
              "| plan | ub/b | op offload | PP t/s | TG t/s | measured MiB | predicted MiB | error MiB | error % | "
              "goal MiB | ok | log: model+kv+compute MiB | predicted w+kv+c+ovh MiB |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for p in plans:
        m, c, k = p["measurement"], p["cuda0"], p["knobs"]
        pr = p["predicted"].get("CUDA0")
        lg = p.get("log_cuda0")
        pp = f"{m['pp_tps']:.1f}" if m["ok"] else f"FAILED: {m['error'][:60]}"
        within = "-" if c["within_goal"] is None else ("yes" if c["within_goal"] else "**no**")
        pct = "-" if c["error_pct"] is None else f"{c['error_pct']:+.1f}"
        logged = "-" if not lg else f"{_mib(lg['model'])}+{_mib(lg['kv'])}+{_mib(lg['compute'] + lg['output'])}"
        parts = "-" if not pr else "+".join(_mib(pr[x]) for x in ("weights", "kv", "compute", "overhead"))
        lines.append(
            f"| {p['name']} | {k['n_ubatch']}/{k['n_batch']} | {'on' if k['op_offload'] else 'off'} | {pp} | "
            f"{m['tg_tps']:.2f} | {_mib(c['measured_bytes'])} | {_mib(c['predicted_bytes'])} | "
            f"{_mib(c['error_bytes'])} | {pct} | {_mib(c['goal_bytes'])} | {within} | {logged} | {parts} |")
    over = [p for p in plans if p["cuda0"]["within_goal"] is False]
    lines += ["", f"{sum(1 for p in plans if p['cuda0']['within_goal'])} of "
              f"{sum(1 for p in plans if p['cuda0']['within_goal'] is not None)} measured plans within the goal "
              f"|error| <= max(3%, 256 MiB)" + (f"; over: {', '.join(p['name'] for p in over)}" if over else "") + ".",
              "error = predicted - measured; measured = peak device memory in use during the run minus the reading "
              "before it (CUDA context included).", ""]
    lines += ["## llama.cpp --fit (llama-bench -fitt) vs the best plan at or under each budget", "",
              "| budget | --fit PP | --fit TG | --fit VRAM MiB | llama-fit-params choice (pp context) | "
              "predicted for it MiB | "
              "best TG plan <= budget | PP | TG | VRAM MiB | best PP plan <= budget | PP | TG | VRAM MiB |",
              "|---|---:|---:|---:|---|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for f in fits:
        b = f["budget_gib"] * GiB
        m = f["measurement"]
        bt, bp = best_under(plans, b, "tg_tps"), best_under(plans, b, "pp_tps")
        pred = f.get("predicted_for_choice") or {}
        pred_c0 = pred.get("CUDA0", {}).get("total") if isinstance(pred.get("CUDA0"), dict) else None
        choice = (f.get("fit_params_flags") or "-").replace("|", "\\|")
        if len(choice) > 80:
            choice = choice[:77] + "..."

        def cells(p: dict[str, Any] | None) -> str:
            if p is None:
                return "- | - | - | -"
            pm = p["measurement"]
            return f"{p['name']} | {pm['pp_tps']:.1f} | {pm['tg_tps']:.2f} | {_mib(p['cuda0']['measured_bytes'])}"
        fit_pp = f"{m['pp_tps']:.1f}" if m["ok"] else f"FAILED: {m['error'][:50]}"
        lines.append(f"| {f['budget_gib']} GiB | {fit_pp} | {m['tg_tps']:.2f} | {_mib(f['measured_bytes'])} | "
                     f"`{choice}` | {_mib(pred_c0)} | {cells(bt)} | {cells(bp)} |")
    lines += ["", "llama-bench fits each test's context separately (pp: n_prompt, tg: n_gen tokens), so --fit's TG "
              "test may hold more layers than its PP test; llama-fit-params shows the choice for the PP context.", ""]
    if matcher:
        lines += ["## Matcher and -ngl slots vs the loader's -v lines (tiny model)", "",
                  "| arguments | agrees | tensors | overridden | first mismatches |", "|---|---|---:|---:|---|"]
        for r in matcher:
            mism = "; ".join(f"{x['tensor']}: ours {x['ours']}, llama.cpp {x['llama.cpp']}"
                             for x in r.get("mismatches", [])[:3])
            args_cell = " ".join(r["args"]).replace("|", "\\|")
            lines.append(f"| `{args_cell}` | {'yes' if r['ok'] else '**no**'} | {r.get('n_tensors', '-')} | "
                         f"{r.get('n_overridden', '-')} | {r.get('error', mism) or '-'} |")
        lines.append("")
    (out_dir / "llamacpp_gpu.md").write_text("\n".join(lines) + "\n")
    n_runs = write_runs(plans, out_dir / "llamacpp_gpu_runs.jsonl")
    log(f"report: {out_dir / 'llamacpp_gpu.md'} and .json ({len(plans)} plans, {len(fits)} budgets), "
        f"{n_runs} runs in llamacpp_gpu_runs.jsonl")


def write_runs(plans: list[dict[str, Any]], path: Path) -> int:
    """Every plan measured on the GPU as a line of the shared runs format (llama_bench_args after -m MODEL, env,
    pp_tps, tg_tps, peak_vram_mib), so benchmarks/cost_model.py can score the cost model on this call's runs:
    the op offload on/off pairs among the plans included."""
    n = 0
    with path.open("w") as f:
        for p in plans:
            m = p.get("measurement") or {}
            if p.get("cpu_mode") or not m.get("ok"):
                continue
            f.write(json.dumps(run_line(p["command"], m["pp_tps"], m["tg_tps"],
                                        sum((m.get("peak_bytes") or {}).values()) // MiB,
                                        study="llamacpp_gpu", plan=p["name"])) + "\n")
            n += 1
    return n


# ---- main ------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    opts.add_call_options(ap, name=None, workdir=DEFAULT_WORKDIR, time_budget=480.0, min_left=90.0, timeout=180.0,
                          cpu_help="the CPU build and a tiny model (no GPU)",
                          min_left_help="a new run needs: no new plan or --fit run starts with less left")
    ap.add_argument("--llama-bench", type=Path, help="default <workdir>/llama.cpp-cuda/build/bin/llama-bench")
    ap.add_argument("--fit-params", type=Path, help="default beside llama-bench")
    ap.add_argument("--model", type=Path, help="default <workdir>/qwen3-30b-a3b-q4_0.gguf (written if missing)")
    opts.add_step_options(ap, STEPS)
    ap.add_argument("--budgets", default="4,8,12,16", help="GiB budgets for --fit and planner plans")
    opts.add_workload_options(ap, DEFAULTS)
    ap.add_argument("--model-min-left", type=float, default=200.0,
                    help="seconds the model write needs; with less left it waits for the next call (default 200)")
    args = opts.resolve(ap, ap.parse_args(argv), DEFAULTS)
    t_start = time.monotonic()
    steps = opts.parse_steps(ap, args.steps, STEPS)
    args.plans = [p for p in args.plans.split(",") if p]
    args.budgets = opts.parse_budgets(ap, args.budgets)
    workdir = args.workdir or (DEFAULT_WORKDIR / "cpu" if args.cpu else DEFAULT_WORKDIR)
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else workdir / "report")
    results_dir = workdir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    wl = BenchRun(args.n_prompt, args.n_gen, 0, args.reps)
    if args.cpu:
        from runtime.llamacpp_build import ensure_built
        built = ensure_built()
        bench, fit_params = args.llama_bench or built["llama-bench"], args.fit_params or built["llama-fit-params"]
    else:
        bench = args.llama_bench or workdir / "llama.cpp-cuda" / "build" / "bin" / "llama-bench"
        fit_params = args.fit_params or bench.with_name("llama-fit-params")
    model = args.model or workdir / ("tiny-qwen3moe-q4_0.gguf" if args.cpu else "qwen3-30b-a3b-q4_0.gguf")
    hw = load_hardware(args.hardware)
    if not model.exists() and not args.cpu and time_left(args, t_start) < args.model_min_left:
        log(f"model: not written in this call ({time_left(args, t_start):.0f} s left of --time-budget, writing 17 GB "
            f"needs ~{args.model_min_left:.0f} s); run again")
        return 3
    if "model" in steps or not model.exists():
        write_model(model, args.cpu)
    inv = load_inventory(model)
    cases = make_cases(inv, hw, args.budgets, wl.n_prompt)
    if args.list:
        for c in cases:
            print(f"{c.name:28s} {c.what}")
        return 0
    unknown = [p for p in args.plans if p not in {c.name for c in cases}]
    if unknown:
        ap.error(f"unknown plan {unknown[0]!r}; --list shows them")
    if not bench.exists():
        ap.error(f"no llama-bench at {bench}: run `bash benchmarks/llamacpp_gpu.sh build TARBALL` first")
    engine = LlamaCppEngine(bench, timeout_s=args.timeout, model_path=model, verbose=True)
    devs = engine.devices() or {}
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu_mode": args.cpu, "binary": engine.info.to_dict(), "devices": devs,
            "gpu": ", ".join(f"{d}: {v['description']}" for d, v in devs.items()) or None,
            "vram_source": engine.sampler().source if engine.sampler() else "none",
            "model": str(model), "model_gib": model.stat().st_size / GiB, "hardware": hw.name,
            "workload": {"n_prompt": wl.n_prompt, "n_gen": wl.n_gen, "depth": wl.depth, "repetitions": wl.repetitions},
            "case_order": [c.name for c in cases], "goal": "max(3%, 256 MiB)"}
    if not args.cpu and not devs:
        log("warning: llama-bench lists no GPU; the plans will be refused (use --cpu for a dry run)")
    matcher_file = workdir / "matcher.json"

    def write_report() -> None:   # after every result, so a call cut off at its limit still returns a report
        matcher = json.loads(matcher_file.read_text()) if matcher_file.exists() else None
        report(meta, load_results(results_dir, "plan"), load_results(results_dir, "fit"), matcher, out_dir)

    if "matcher" in steps and (args.redo or not matcher_file.exists()):
        tiny = workdir / "tiny-matcher.gguf"
        if not tiny.exists():
            from runtime.synth import tiny_spec, uniform_recipe, write_gguf
            write_gguf(tiny, tiny_spec("qwen3moe", n_layer=6), uniform_recipe("Q8_0"))
        write_json(matcher_file, run_matcher(bench, tiny, args.cpu))
    done = True
    if "fit" in steps:
        done = run_fit(args, engine, fit_params, inv, hw, wl, results_dir, t_start, write_report)
    if "plans" in steps and done:
        done = run_plans(args, engine, inv, hw, cases, wl, results_dir, t_start, write_report)
    write_report()
    missing = [c.name for c in cases if not (results_dir / f"plan-{c.name}.json").exists()]
    if missing:
        log(f"not measured yet: {', '.join(missing)}")
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())
