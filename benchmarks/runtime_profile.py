"""Where the torch engine's GPU time goes: one prompt ubatch and a run of decode steps under torch.profiler.

The Qwen3-30B-A3B-shaped model of runtime_roofline.py (bf16, weights synthesized on the GPU), a placement of that
benchmark (default: all on GPU), one PP ubatch of --ubatch tokens and --n-gen decode steps (CUDA graphs as the
engine runs them; the profiler sees the kernels inside the graphs). Writes runtime_profile.json (every kernel:
name, calls, total and mean device time) and runtime_profile.md (the top --top kernels of each phase) into --out.

On the GPU machine:  python3 benchmarks/runtime_profile.py --out $OUT [--n-cpu-moe 0] [--ubatch 2048]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from benchmarks.runtime_roofline import inventory, plan_for  # noqa: E402
from runtime.torch_engine import TorchEngine  # noqa: E402


def _timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _kernels(prof) -> list[dict]:
    """Device-side events (kernels, copies, memsets) by name, the most time first."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0:
            rows.append({"name": e.key, "calls": e.count, "total_us": t, "mean_us": t / max(e.count, 1)})
    return sorted(rows, key=lambda r: -r["total_us"])


def _profiled(fn) -> list[dict]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return _kernels(prof)


def _table(title: str, rows: list[dict], top: int, per: int, unit: str) -> list[str]:
    total = sum(r["total_us"] for r in rows)
    out = [f"## {title}", "", f"Device time {total / 1e3:.2f} ms in all ({total / per:.1f} us per {unit}).", "",
           "| kernel | calls | total ms | share | mean us |", "|---|---|---|---|---|"]
    for r in rows[:top]:
        out.append(f"| `{r['name'][:90]}` | {r['calls']} | {r['total_us'] / 1e3:.2f} | "
                   f"{100 * r['total_us'] / total:.1f}% | {r['mean_us']:.1f} |")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--n-cpu-moe", type=int, default=0, help="layers whose experts are in RAM (0: all on GPU)")
    ap.add_argument("--ubatch", type=int, default=2048)
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("runtime_profile: no CUDA GPU here", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    inv = inventory(False)
    plan = plan_for(inv, args.n_cpu_moe, args.ubatch, args.threads)
    model = TorchEngine().load(inv, plan, min_cells=args.ubatch + args.n_gen + 256)
    hp = inv.hparams
    prompt = torch.randint(0, hp.n_vocab, (args.ubatch,), generator=torch.Generator().manual_seed(0))

    def pp() -> None:
        model.prefill(prompt, 0, args.ubatch)

    def tg() -> None:
        tok = 1
        for i in range(args.n_gen):
            tok = model.decode(tok, args.ubatch + i)
    pp_s, tg_s = _timed(pp, 3), _timed(tg, 3)
    pp_rows, tg_rows = _profiled(pp), _profiled(tg)
    meta = {"model": inv.name, "placement": plan.label, "ubatch": args.ubatch, "n_gen": args.n_gen,
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "pp_tps": args.ubatch / pp_s, "tg_tps": args.n_gen / tg_s}
    (out / "runtime_profile.json").write_text(json.dumps({"meta": meta, "pp": pp_rows, "tg": tg_rows}, indent=2) + "\n")
    md = [f"# Torch engine profile: {inv.name}, {plan.label} ({meta['device']}, torch {meta['torch']})", "",
          f"PP: one ubatch of {args.ubatch} tokens, {meta['pp_tps']:.0f} t/s unprofiled. "
          f"TG: {args.n_gen} decode steps, {meta['tg_tps']:.1f} t/s unprofiled.", ""]
    md += _table(f"Prompt ubatch ({args.ubatch} tokens, {hp.n_layer} layers)", pp_rows, args.top, hp.n_layer, "layer")
    md += _table(f"Decode ({args.n_gen} steps)", tg_rows, args.top, args.n_gen * hp.n_layer, "layer and token")
    (out / "runtime_profile.md").write_text("\n".join(md))
    print("\n".join(md))
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
