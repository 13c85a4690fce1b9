"""Four GPUs and a model that needs them (issue 30 item 2): a Qwen3-235B-A22B-shaped model written by the
project's writer as uniform Q4_0 (~123 GiB: no single 80 GiB card holds it), placed over four GPUs and measured
with the mainline CUDA llama-bench, on a machine with four GPUs (nvidia-h100-x4 / nvidia-h200-x4, 512 GiB RAM).

Steps (--steps, in this order):
- memory: >= 10 four-GPU plans (make_cases): layer splits (-ts even and uneven), pipeline parallelism at -ub 2048,
  experts in RAM (the last layers', -ncmoe with an even and a hand-balanced -ts, all of them with and without op
  offload), experts on another GPU than their layer, every block on CUDA0 with the experts spread over the others
  and the output layer on CUDA3, and the planner's own best-TG plans at 4x16, 4x24 and 24+16+16+8 GiB (cards of
  different sizes). Per GPU the peak VRAM planner.memory predicts against the peak sampled on that GPU (NVML, per
  device), the |error| against max(3%, 256 MiB). One run each (-p 2048 -n 32 -r 1: the peak is what is measured).
- report: NAME.md and NAME.json (default four_gpu) in --out: per plan and GPU predicted and measured MiB, the error
  and whether it is within the goal; rewritten after every plan.

The studies per budget against --fit are benchmarks/workload_vs_fit.py's, with this model and four GPUs (explored
here first with --prepare and carried as the study database: the newest state, workload_vs_fit_h200x2_state.db.gz,
holds every study of that benchmark; the served --fit and finalists report VRAM per GPU), every contender at the
thread count benchmarks/threads_sweep.py finds best:
    N=$(python3 benchmarks/threads_sweep.py --model MODEL --name threads_KIND --out $OUT | tail -1)
    python3 benchmarks/workload_vs_fit.py --preset Qwen3-235B-A22B:Q8_0 --threads 0 --serve-threads $N \
      --cells 24+16+16+8:rag,4x24:rag,4x16:rag --finalists 1 --name workload_vs_fit_KIND

State (kept between calls, carried to a fresh machine): <workdir> = benchmarks/results/four_gpu: results/ (one JSON
per plan). The model lives in the workload_vs_fit workdir (model/qwen3-235b-a22b-shape-q4_0.gguf, the file
workload_vs_fit serves; written again on a fresh machine, ~1-2 min) and the CUDA build in llamacpp_gpu's. Every call
writes NAME_state.tar.gz beside the report; `tar -xzf FILES_AT/NAME_state.tar.gz -C benchmarks/results/four_gpu`
here before the next call on a fresh machine. Exit 3 while work is left, 0 when done, 2 on bad input.

Device call (timeout_s 600, carry [".whl", "build/llama.cpp-src.tar.gz", "benchmarks/results/four_gpu"]):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 && \
    bash benchmarks/llamacpp_gpu.sh build-server build/llama.cpp-src.tar.gz && \
    python3 benchmarks/four_gpu.py --name four_gpu_h100x4 --time-budget $((560 - SECONDS))
Here, without a GPU: `.venv/bin/python benchmarks/four_gpu.py --cpu` (tiny model, four logical GPUs predicted,
every plan run all-CPU, ~20 s).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_options as opts  # noqa: E402
import llamacpp_gpu as lg  # noqa: E402
import multi_gpu as mg  # noqa: E402
from planner.errors import BudgetError  # noqa: E402
from planner.gguf_header import load_inventory  # noqa: E402
from planner.hardware import GiB, HardwareProfile, load_hardware  # noqa: E402
from planner.model import ModelInventory, Tensor  # noqa: E402
from planner.plan import Knobs, OffloadPolicy, Plan  # noqa: E402
from planner.engine_contract import BenchRun  # noqa: E402
from runtime.llamacpp import LlamaCppEngine  # noqa: E402

GPUS = ("CUDA0", "CUDA1", "CUDA2", "CUDA3")
PRESET = "Qwen3-235B-A22B:Q8_0"           # shape only: written with the uniform Q4_0 recipe (llamacpp_gpu.QUANT)
MODEL_REL = Path("benchmarks/results/workload_vs_fit/model/qwen3-235b-a22b-shape-q4_0.gguf")   # workload_vs_fit's
DEFAULT_WORKDIR = ROOT / "benchmarks" / "results" / "four_gpu"
STEPS = ("memory", "report")
PLANNER_BUDGETS = ((16, 16, 16, 16), (24, 24, 24, 24), (24, 16, 16, 8))     # GiB per GPU
DEFAULTS: opts.Defaults = {"n_prompt": (2048, 32), "n_gen": (32, 4), "reps": (1, 1)}
TINY_SPEC = {"arch": "qwen3moe", "n_layer": 12, "n_expert": 16, "n_expert_used": 4}     # 12 layers: 4 GPUs x 3


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def ts_counts(inv: ModelInventory, shares: tuple[float, ...]) -> tuple[int, ...]:
    """Layer counts per GPU of the n_layer + 1 slots for these shares (what -ts a,b,c,d does), each >= 1."""
    slots = inv.hparams.n_layer + 1
    total = sum(shares)
    counts = [max(1, math.floor(s / total * slots + 0.5)) for s in shares[:-1]]
    return (*counts, slots - sum(counts))


def make_cases(inv: ModelInventory, hw: HardwareProfile, n_prompt: int,
               planner_budgets: tuple[tuple[int, ...], ...] = PLANNER_BUDGETS) -> list[mg.Case]:
    """The four-GPU plans of the memory table (module docstring), the planner's own plans last."""
    moe = inv.moe_layers()
    n = len(moe)
    k40, ncm = max(1, round(0.4 * n)), max(1, n // 3)
    last40, first_half = set(moe[-k40:]), set(moe[: n // 2])
    base = Knobs(n_ctx=n_prompt, n_batch=2048, n_ubatch=512)
    ub2048 = replace(base, n_batch=max(2048, n_prompt), n_ubatch=2048)
    even = ts_counts(inv, (1, 1, 1, 1))
    two_one = ts_counts(inv, (2, 1, 1, 1))
    # -ncmoe N keeps the first N layers' experts in RAM: a user hands CUDA0 more layers to even the GPUs out
    ncm_share = 1 + 3 * ncm / (inv.hparams.n_layer + 1)
    ncm_counts = ts_counts(inv, (ncm_share, 1, 1, 1))
    blocks_on_0 = (inv.hparams.n_layer - 2, 1, 1, 1)      # CUDA1-3 hold one slot each, CUDA3 the output layer
    spread = {layer: GPUS[1 + i * 3 // n] for i, layer in enumerate(moe)}      # thirds of the experts on CUDA1-3

    def split(counts: tuple[int, ...], experts: Callable[[Tensor, str], str] | None = None) -> dict[str, str]:
        return mg.split_assignment(inv, counts, experts, gpus=GPUS)

    def ram_if(pred: Callable[[Tensor], bool]) -> Callable[[Tensor, str], str]:
        return lambda t, home: "CPU" if pred(t) else home

    def next_gpu(t: Tensor, home: str) -> str:
        return GPUS[(GPUS.index(home) + 1) % len(GPUS)]

    def ncmoe(t: Tensor, home: str) -> str:
        return "CPU" if t.layer is not None and t.layer < ncm else home

    def plan(a: dict[str, str], knobs: Knobs = base) -> Plan:
        return Plan("m", a, knobs)

    ts = ",".join
    cases = [
        mg.Case("ts-1-1-1-1", f"every tensor on the GPUs, -ts 1,1,1,1 ({ts(map(str, even))} slots; pipeline "
                "parallel)", plan(split(even))),
        mg.Case("ts-1-1-1-1-ub2048", "as ts-1-1-1-1, -ub 2048 -b 2048 (pipeline parallelism's input copies at 2048 "
                "tokens)", plan(split(even), ub2048)),
        mg.Case("ts-2-1-1-1", f"every tensor on the GPUs, -ts 2,1,1,1 ({ts(map(str, two_one))} slots)",
                plan(split(two_one))),
        mg.Case(f"ts-1-1-1-1-exps-last{k40}", f"-ts 1,1,1,1, the experts of the last {k40} MoE layers in RAM",
                plan(split(even, ram_if(lambda t: t.layer in last40)))),
        mg.Case(f"ncmoe{ncm}-ts-1-1-1-1", f"-ncmoe {ncm} -ts 1,1,1,1: the experts of the first {ncm} layers in RAM",
                plan(split(even, ncmoe))),
        mg.Case(f"ncmoe{ncm}-ts-{'-'.join(map(str, ncm_counts))}", f"-ncmoe {ncm} with the split moved towards "
                f"CUDA0 ({ts(map(str, ncm_counts))} slots) to even the GPUs out", plan(split(ncm_counts, ncmoe))),
        mg.Case("exps-next-gpu", "-ts 1,1,1,1 homes, every layer's experts on the next GPU (=CUDA(i+1) in -ot): "
                "activations cross GPUs twice per layer", plan(split(even, next_gpu))),
        mg.Case("attn0-exps-spread-out3", f"every block homed on CUDA0 (-ts {ts(map(str, blocks_on_0))}), the "
                "experts by thirds on CUDA1, CUDA2, CUDA3, the output layer on CUDA3",
                plan(split(blocks_on_0, lambda t, home: spread[t.layer]))),
        mg.Case("cmoe-ts-1-1-1-1", "-ts 1,1,1,1, every expert in RAM (-cmoe), op offload on (the prompt's experts "
                "run on CUDA0)", plan(split(even, ram_if(lambda t: True)))),
        mg.Case("cmoe-ts-1-1-1-1-nopo", "as cmoe-ts-1-1-1-1, op offload off (-nopo 1)",
                plan(split(even, ram_if(lambda t: True)), replace(base, offload=OffloadPolicy.all(False)))),
        mg.Case("half-exps-ram-ts-1-1-1-1-ub2048", f"-ts 1,1,1,1, the experts of the first {len(first_half)} "
                "layers in RAM, -ub 2048: op offload's uploads to CUDA0 at 2048 tokens",
                plan(split(even, ram_if(lambda t: t.layer in first_half)), ub2048)),
    ]
    from planner.propose import best_plans
    for budgets in planner_budgets:
        label = f"4x{budgets[0]}G" if len(set(budgets)) == 1 else "-".join(map(str, budgets)) + "G"
        try:
            best = best_plans(inv, hw.with_vram([b * GiB for b in budgets]), base, "mainline", "tg", lg.GOAL_FLOOR,
                              n_prompt)[0]
        except BudgetError as e:
            log(f"memory: no planner plan at {label}: {e}")
            continue
        cases.append(mg.Case(f"planner-{label}", f"offload-tuner plan's best TG plan for "
                             f"{' + '.join(map(str, budgets))} GiB ({best.plan.label})", best.plan))
    return [replace(c, plan=replace(c.plan, model_id=inv.source, label=c.name)) for c in cases]


def report(meta: dict[str, Any], plans: list[dict[str, Any]], out: Path, name: str) -> None:
    order = {n: i for i, n in enumerate(meta.get("case_order", []))}
    plans = sorted(plans, key=lambda p: order.get(p["name"], len(order)))
    checked = [(p, d, r) for p in plans for d, r in p["devices"].items() if r["within_goal"] is not None]
    summary = {"plans": len(plans), "plans_measured": sum(1 for p in plans if p["within_goal"] is not None),
               "plans_within_goal": sum(1 for p in plans if p["within_goal"]),
               "gpu_rows": len(checked), "gpu_rows_within_goal": sum(1 for _, _, r in checked if r["within_goal"]),
               "max_abs_error_mib": max((abs(r["error_mib"]) for _, _, r in checked), default=None)}
    out.mkdir(parents=True, exist_ok=True)
    lg.write_json(out / f"{name}.json", {"meta": meta, "summary": summary, "memory": plans})
    L = ["# Four GPUs: memory per GPU, predicted against measured", "",
         f"{meta['date']}; {meta.get('gpu') or 'no GPU (CPU dry run: predicted only)'}; model {meta['model']} "
         f"({meta['model_gib'] or 0:.1f} GiB); llama-bench -p {meta['n_prompt']} -n {meta['n_gen']} -r 1; goal "
         f"{meta['goal']} on each GPU.", "",
         f"{summary['plans_within_goal']} of {summary['plans_measured']} measured plans within the goal on every "
         f"GPU ({summary['gpu_rows_within_goal']} of {summary['gpu_rows']} GPU rows); largest error "
         f"{summary['max_abs_error_mib'] if summary['max_abs_error_mib'] is not None else '-'} MiB.", "",
         "| plan | PP t/s | TG t/s | " + " | ".join(f"{d} measured / predicted MiB (error)" for d in GPUS)
         + " | within |", "|---|---|---|" + "---|" * len(GPUS) + "---|"]
    for p in plans:
        m = p["measurement"]
        cells = []
        for d in GPUS:
            r = p["devices"].get(d) or {}
            meas = "-" if r.get("measured_mib") is None else f"{r['measured_mib']:,.0f}"
            err = "" if r.get("error_mib") is None else f" ({r['error_mib']:+,.0f})"
            cells.append(f"{meas} / {r.get('predicted_mib') or 0:,.0f}{err}")
        ok = {True: "yes", False: "NO", None: "-"}[p["within_goal"]]
        speeds = f"{m['pp_tps']:.1f} | {m['tg_tps']:.2f}" if m["ok"] else f"failed: {m['error'][:80]} | -"
        L.append(f"| {p['name']} | {speeds} | " + " | ".join(cells) + f" | {ok} |")
    L += ["", "Plans:", ""] + [f"- {p['name']}: {p['what']}. `{p['flags']}`" for p in plans]
    if mg.plot_shares([("llama.cpp (llama-bench)", plans)], GPUS, out / f"{name}.png",
                      "Four GPUs: each GPU's share and the prediction's error per plan"):
        L += ["", f"![memory per GPU]({name}.png)"]
    if meta.get("note"):
        L += ["", meta["note"]]
    (out / f"{name}.md").write_text("\n".join(L) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    opts.add_call_options(ap, name="four_gpu", workdir=DEFAULT_WORKDIR, time_budget=560.0, min_left=90.0,
                          timeout=420.0, cpu_help="tiny model, four GPUs predicted, every plan run all-CPU",
                          min_left_help="a new plan needs (a 123 GiB model loads in about a minute)",
                          hardware_help="its GPU repeated four times, at the cards' sizes")
    opts.add_workload_options(ap, DEFAULTS)
    opts.add_step_options(ap, STEPS)
    ap.add_argument("--llama-bench", type=Path, help="default <llamacpp_gpu workdir>/llama.cpp-cuda/build/bin/...")
    ap.add_argument("--note", type=Path, help="a Markdown file of notes for the report")
    ap.add_argument("--report-only", type=Path, metavar="JSON", help="rewrite the report from <workdir>'s results, "
                    "running nothing, with the meta (machine, binary, model) of this earlier four_gpu report")
    args = opts.resolve(ap, ap.parse_args(argv), DEFAULTS)
    steps = opts.parse_steps(ap, args.steps, STEPS)
    t_start = time.monotonic()
    args.plans = [p for p in args.plans.split(",") if p]
    workdir = args.workdir or (DEFAULT_WORKDIR.with_name("four_gpu_cpu") if args.cpu else DEFAULT_WORKDIR)
    results_dir = workdir / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else workdir / "report")
    if args.report_only:
        try:
            meta = json.loads(args.report_only.read_text())["meta"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"four_gpu: --report-only {args.report_only}: not a four_gpu report ({e})", file=sys.stderr)
            return 2
        if args.note:
            meta["note"] = args.note.read_text()
        report(meta, lg.load_results(results_dir, "plan"), out, args.name)
        return 0
    wl = BenchRun(args.n_prompt, args.n_gen, 0, args.reps)
    if args.cpu:
        from runtime.llamacpp_build import ensure_built
        bench = args.llama_bench or ensure_built()["llama-bench"]
        model = workdir / "tiny-qwen3moe-12l-q4_0.gguf"
    else:
        bench = args.llama_bench or lg.DEFAULT_WORKDIR / "llama.cpp-cuda" / "build" / "bin" / "llama-bench"
        model = ROOT / MODEL_REL
    if not bench.exists():
        print(f"four_gpu: no llama-bench at {bench}: run `bash benchmarks/llamacpp_gpu.sh build TARBALL` first",
              file=sys.stderr)
        return 2
    if "memory" in steps:
        lg.write_model(model, args.cpu, preset=PRESET, tiny_spec_args=TINY_SPEC,
                       vocab=not args.cpu)     # with a vocabulary: workload_vs_fit serves this same file
    inv = load_inventory(model) if model.exists() else None
    if inv is None:
        print(f"four_gpu: no model at {model}: run the memory step first", file=sys.stderr)
        return 2
    if model.resolve().is_relative_to(ROOT):
        inv = replace(inv, source=str(model.resolve().relative_to(ROOT)))
    engine = LlamaCppEngine(bench, timeout_s=args.timeout, model_path=model, verbose=True)
    devs = engine.devices() or {}
    gpu_bytes = [devs[d]["total_bytes"] for d in GPUS if d in devs]
    hw = load_hardware(args.hardware).with_vram(gpu_bytes if len(gpu_bytes) == len(GPUS) else [80 * GiB] * 4)
    cases = make_cases(inv, hw, wl.n_prompt, ((1, 1, 1, 1),) if args.cpu else PLANNER_BUDGETS)
    if args.list:
        for c in cases:
            print(f"{c.name:34s} {c.what}")
        return 0
    unknown = [p for p in args.plans if p not in {c.name for c in cases}]
    if unknown:
        print(f"four_gpu: unknown plan {unknown[0]!r}; --list shows them", file=sys.stderr)
        return 2
    if not args.cpu and sum(1 for d in devs if d.startswith("CUDA")) < len(GPUS):
        log(f"warning: llama-bench lists {', '.join(devs) or 'no GPU'}; four GPUs are needed (--cpu for a dry run)")
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpu_mode": args.cpu, "binary": engine.info.to_dict(), "devices": devs,
            "gpu": ", ".join(f"{d}: {v['description']}" for d, v in devs.items() if d.startswith("CUDA")) or None,
            "model": str(MODEL_REL) if not args.cpu else model.name, "model_gib": model.stat().st_size / GiB,
            "hardware": f"{args.hardware} x{len(GPUS)}", "goal": "max(3%, 256 MiB) per GPU",
            "n_prompt": wl.n_prompt, "n_gen": wl.n_gen, "case_order": [c.name for c in cases]}
    if args.note:
        meta["note"] = args.note.read_text()
    state = out / f"{args.name}_state.tar.gz"

    def write_report() -> None:
        report(meta, lg.load_results(results_dir, "plan"), out, args.name)
        opts.pack_state(workdir, None, state)

    done = True
    if "memory" in steps:
        for i, case in enumerate(c for c in cases if not args.plans or c.name in args.plans):
            path = results_dir / f"plan-{case.name}.json"
            if path.exists() and not args.redo:
                continue
            if lg.time_left(args, t_start) < args.min_left:
                log("memory: stopping before the time budget ends; run again to continue")
                done = False
                break
            log(f"memory: [{i + 1}/{len(cases)}] {case.name}: {case.what}")
            rec = mg.measure_case(engine, inv, case, wl, hw, args.cpu, gpus=GPUS)
            mg.log_result("memory", case.name, rec)
            lg.write_json(path, rec)
            write_report()
    write_report()
    log("all done" if done else "work left: run again")
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())
