"""Torch-engine speed next to the roofline, on the GPU machine (issue 3's acceptance table).

A Qwen3-30B-A3B-shaped model (preset qwen3-30b-a3b, weights synthesized in memory in bf16, no file) is placed
"all on GPU" and with the routed experts of the first 12/24/36/48 layers in RAM (-ngl 99 --n-cpu-moe N), and
measured at ubatch 512 and 2048: TG (n_gen greedy steps) and PP (one ubatch of n_prompt = ubatch tokens),
next to the roofline from calibrated ceilings:
- TG: the bytes one token reads on each device over that device's bandwidth, summed (GPU GEMV bandwidth for
  everything resident on the GPU, host GEMV bandwidth for the routed experts in RAM);
- PP: per ubatch, max(compute, upload): compute = the sum over the ubatch's matmuls and attentions of
  max(FLOPs / GPU GEMM rate, weight bytes / GPU bandwidth) (planner/cost.py's per-op roofline), upload = bytes
  uploaded for the offloaded expert ops (measured) / pinned host->GPU bandwidth. The JSON also has the looser
  bound with compute = max(total FLOPs / rate, total bytes / bandwidth), as if every op overlapped every other.
Writes runtime_roofline.json and runtime_roofline.md into --out after every row.

On the GPU machine (python3 there has torch, no gguf or optuna; neither is needed here):
    python3 benchmarks/runtime_roofline.py --out $OUT                       # everything, ~6-8 min
    python3 benchmarks/runtime_roofline.py --out $OUT --placements 0,24    # a subset
    python3 benchmarks/runtime_roofline.py --out $OUT --hardware hw.json   # ceilings from `calibrate --out`
Here (no GPU), a smoke run on a tiny model and logical GPUs:  .venv/bin/python benchmarks/runtime_roofline.py --smoke
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from planner.model import ModelInventory  # noqa: E402
from planner.plan import Knobs, Plan  # noqa: E402
from planner.engine_contract import BenchRun  # noqa: E402
from runtime.torch_engine import TorchEngine  # noqa: E402
from runtime.torch_engine.placement import is_float32_tensor  # noqa: E402

GB = 1e9


# ---- the model and its placements ----------------------------------------------------------------------------------

def inventory(smoke: bool) -> ModelInventory:
    if smoke:
        from planner.archs import build_inventory
        from runtime.synth import tiny_spec, uniform_recipe
        return build_inventory(tiny_spec("qwen3moe", n_layer=4, n_expert=16, n_expert_used=4), uniform_recipe("Q8_0"),
                               name="tiny-qwen3moe")
    from planner.presets import load_preset
    return load_preset("qwen3-30b-a3b").inventory()


def plan_for(inv: ModelInventory, n_cpu_moe: int, ubatch: int, threads: int) -> Plan:
    """-ngl 99 --n-cpu-moe N: every tensor on CUDA0 but token_embd and the routed experts of layers < N."""
    assignment = {}
    for t in inv.allocated():
        on_cpu = t.role == "token_embd" or (t.is_expert and t.layer is not None and t.layer < n_cpu_moe)
        assignment[t.name] = "CPU" if on_cpu else "CUDA0"
    knobs = Knobs(n_ctx=4096, n_batch=max(2048, ubatch), n_ubatch=ubatch, n_threads=threads)
    label = f"experts of {n_cpu_moe} layers in RAM" if n_cpu_moe else "all on GPU"
    return Plan(inv.name, assignment, knobs, label=label)


# ---- ceilings and rooflines ------------------------------------------------------------------------------------------

def ceilings(args: argparse.Namespace) -> dict[str, float]:
    if args.smoke:
        return {"gpu_bw": 50 * GB, "gpu_flops": 1e12, "cpu_bw": 50 * GB, "h2d": 20 * GB, "source": "smoke (made up)"}
    if args.hardware:
        from planner.hardware import load_hardware
        hw = load_hardware(args.hardware)
        return {"gpu_bw": hw.gpus[0].mem_bw, "gpu_flops": hw.gpus[0].flops, "cpu_bw": hw.host.mem_bw,
                "h2d": hw.link.h2d_pinned, "source": args.hardware}
    from runtime.calibrate import measure_gpu, measure_host
    g = measure_gpu(0, args.dtype)
    h = measure_host(args.dtype, threads=args.threads)
    return {"gpu_bw": g["gemv_bytes_per_s"], "gpu_flops": g["gemm_flops"], "cpu_bw": h["gemv_bytes_per_s"],
            "h2d": g["h2d_pinned_bytes_per_s"], "source": "measured at start (runtime.calibrate)"}


def _bytes(inv: ModelInventory, name: str, esize: int) -> int:
    t = inv.by_name[name]
    return math.prod(t.shape) * (4 if is_float32_tensor(name) else esize)


def tg_roofline(inv: ModelInventory, plan: Plan, esize: int, c: dict[str, float], n_gen: int) -> dict[str, float]:
    hp = inv.hparams
    frac = hp.n_expert_used / hp.n_expert
    gpu = cpu = 0.0
    for t in inv.allocated():
        b = _bytes(inv, t.name, esize)
        if t.role == "token_embd":
            b = b // hp.n_vocab                     # one row
        elif t.is_expert:
            b *= frac
        if plan.assignment[t.name] == "CPU":
            cpu += b
        else:
            gpu += b
    kv_row = sum(hp.n_head_kv[i] * (hp.head_dim_k + hp.head_dim_v) * esize for i in range(hp.n_layer))
    gpu += kv_row * (n_gen / 2)                     # the average cache read over the run (depth 0)
    s = gpu / c["gpu_bw"] + cpu / c["cpu_bw"]
    return {"tg_roof_tps": 1 / s, "tg_gpu_bytes": gpu, "tg_cpu_bytes": cpu}


def pp_roofline(inv: ModelInventory, plan: Plan, esize: int, c: dict[str, float], T: int,
                upload_bytes: float) -> dict[str, float]:
    """One ubatch of T tokens, logits of the last: every expert op runs on the GPU (T >= 32). Compute is summed
    per op, each op at max(FLOPs / GPU rate, bytes / GPU bandwidth), as planner/cost.py does: the kernels run
    one after another, so a memory-bound op (a routed expert at ~T*A/E rows per expert) does not hide under a
    compute-bound one. `pp_roof_overlap_tps` is the looser bound that assumes they overlap perfectly
    (max of the totals). Norms, activations and sorts count nothing (a fused implementation has none)."""
    hp = inv.hparams
    frac_active = 1 - (1 - hp.n_expert_used / hp.n_expert) ** T      # experts any of T tokens is routed to
    flops = read = per_op = 0.0
    for t in inv.allocated():
        if t.role == "token_embd" or len(t.shape) < 2:
            continue
        n = math.prod(t.shape)
        rows = 1 if t.role == "output" else T
        f = 2 * rows * (n * hp.n_expert_used / hp.n_expert if t.is_expert else n)
        b = _bytes(inv, t.name, esize) * (frac_active if t.is_expert else 1)   # staged copies read once too
        flops += f
        read += b
        per_op += max(f / c["gpu_flops"], b / c["gpu_bw"])
    attn = 4 * hp.n_head * hp.head_dim_k * T * (T + 1) / 2                # causal attention at depth 0, a layer
    flops += hp.n_layer * attn
    per_op += hp.n_layer * attn / c["gpu_flops"]
    upload_s = upload_bytes / c["h2d"]
    overlap_s = max(flops / c["gpu_flops"], read / c["gpu_bw"])
    return {"pp_roof_tps": T / max(per_op, upload_s), "pp_roof_overlap_tps": T / max(overlap_s, upload_s),
            "pp_flops": flops, "pp_read_bytes": read, "pp_compute_s": per_op, "pp_upload_s": upload_s,
            "pp_bound": "upload" if upload_s > per_op else "compute"}


def gpu_state() -> str:
    """Clocks, power, temperature and throttle reasons from nvidia-smi (a slow row is often a throttled GPU)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                               "clocks_throttle_reasons.active", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


# ---- output ----------------------------------------------------------------------------------------------------------

def write(out: Path, rows: list[dict], meta: dict) -> None:
    (out / "runtime_roofline.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [f"# Torch engine vs roofline: {meta['model']} ({meta['dtype']}, synthetic weights, {meta['device']})",
             "", f"Ceilings ({meta['ceilings']['source']}): GPU {meta['ceilings']['gpu_bw'] / 1e12:.2f} TB/s, "
             f"{meta['ceilings']['gpu_flops'] / 1e12:.0f} TFLOP/s; CPU {meta['ceilings']['cpu_bw'] / GB:.0f} GB/s; "
             f"H2D pinned {meta['ceilings']['h2d'] / GB:.1f} GB/s. TG = {meta['n_gen']} tokens, PP = one ubatch.", "",
             "PP roofline: per op max(FLOPs / rate, bytes / bandwidth), summed, or the upload if longer; in "
             "brackets the looser bound that lets all ops overlap (max of the totals).", "",
             "| placement | ubatch | TG t/s | TG roofline | TG % | PP t/s | PP roofline | PP % | PP bound | "
             "uploaded GB/ubatch | peak VRAM GiB | notes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tg = (f"{r['tg_tps']:.1f} | {r['tg_roof_tps']:.1f} | {100 * r['tg_tps'] / r['tg_roof_tps']:.0f}%"
              if r.get("tg_tps") else "| |")
        pp = (f"{r['pp_tps']:.0f} | {r['pp_roof_tps']:.0f} ({r['pp_roof_overlap_tps']:.0f}) | "
              f"{100 * r['pp_tps'] / r['pp_roof_tps']:.0f}% ({100 * r['pp_tps'] / r['pp_roof_overlap_tps']:.0f}%) | "
              f"{r['pp_bound']}" if r.get("pp_tps") else "| | |")
        lines.append(f"| {r['placement']} | {r['ubatch']} | {tg} | {pp} | {r.get('upload_gb', 0):.1f} | "
                     f"{r.get('peak_gib', 0):.1f} | {r.get('error', '')} |")
    lines += ["", f"Total wall time {meta.get('wall_s', 0):.0f} s. JSON: runtime_roofline.json (samples, counters)."]
    (out / "runtime_roofline.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results", help="folder for runtime_roofline.{json,md}")
    ap.add_argument("--placements", default="0,12,24,36,48", help="layers whose experts are in RAM (0: all on GPU)")
    ap.add_argument("--ubatch", default="512,2048")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5, help="timed runs per row (the median is reported)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--routing", default="uniform", help="uniform or zipf:S")
    ap.add_argument("--hardware", help="a calibrated profile (offload-tuner calibrate --out); else measured now")
    ap.add_argument("--budget-s", type=float, default=510, help="skip what would start after this many seconds")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny model on logical GPUs (no GPU needed)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if not args.smoke and not torch.cuda.is_available():
        print("runtime_roofline: no CUDA GPU here; use --smoke for a CPU run of the script", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    inv = inventory(args.smoke)
    placements = [int(x) for x in args.placements.split(",")]
    ubatches = [int(x) for x in args.ubatch.split(",")]
    if args.smoke:
        placements = [min(p, inv.n_layer) for p in placements]
        args.threads = 1
    c = ceilings(args)
    esize = 2 if args.dtype == "bf16" else 4
    engine = TorchEngine(compute_dtype=args.dtype, routing=args.routing, use_cuda_graphs=not args.no_graphs,
                         compile=not args.no_compile, device_map="logical" if args.smoke else None)
    meta = {"model": inv.name, "dtype": args.dtype, "n_gen": args.n_gen, "reps": args.reps, "ceilings": c,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.smoke else "CPU",
            "torch": torch.__version__, "threads": args.threads, "routing": args.routing,
            "gpu_state_start": gpu_state()}
    rows: list[dict] = []
    for n_cpu in sorted(set(placements)):
        for i, ub in enumerate(ubatches):
            label = "all on GPU" if n_cpu == 0 else f"experts of {n_cpu} layers in RAM"
            row: dict = {"placement": label, "n_cpu_moe": n_cpu, "ubatch": ub}
            if time.perf_counter() - t_start > args.budget_s:
                row["error"] = "skipped: over --budget-s"
                rows.append(row)
                continue
            plan = plan_for(inv, n_cpu, ub, args.threads)
            wl = BenchRun(n_prompt=ub, n_gen=args.n_gen if i == 0 else 0, repetitions=args.reps)
            t0 = time.perf_counter()
            m = engine.measure(inv, plan, wl)
            row["wall_s"] = time.perf_counter() - t0
            row["ok"] = m.ok
            if not m.ok:
                row["error"] = m.error
            else:
                up = m.raw.get("pp_counters_per_run", {}).get("upload_bytes", 0)
                row.update(pp_tps=m.pp_tps, tg_tps=m.tg_tps, upload_gb=up / GB,
                           peak_gib=m.peak_bytes.get("CUDA0", 0) / 2**30, load_s=m.raw.get("load_s"),
                           pp_samples=m.raw.get("pp_tps_samples"), tg_samples=m.raw.get("tg_tps_samples"),
                           counters_pp=m.raw.get("pp_counters_per_run"), counters_tg=m.raw.get("tg_counters_per_run"),
                           cuda_graphs=m.raw.get("cuda_graphs"))
                row.update(pp_roofline(inv, plan, esize, c, ub, up))
                if m.tg_tps:
                    row.update(tg_roofline(inv, plan, esize, c, args.n_gen))
            rows.append(row)
            meta["wall_s"] = time.perf_counter() - t_start
            write(out, rows, meta)
            print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))}), flush=True)
    meta["wall_s"] = time.perf_counter() - t_start
    meta["gpu_state_end"] = gpu_state()
    write(out, rows, meta)
    print((out / "runtime_roofline.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
