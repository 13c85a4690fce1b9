"""What the torch engine's accountant does not see on a real GPU: for chosen plans of benchmarks/multi_gpu.py's
torch step, the CUDA caching allocator's history during TorchEngine.measure (torch.cuda.memory's recorder, Python
stacks), replayed to the moment each GPU held the most allocated bytes, and the allocations alive then, grouped by
the engine's own line that made them (the innermost frame under runtime/torch_engine/) and by the innermost frame
of all. Beside them the accountant's parts (weights, KV, staging) and its activations, so the gap between the
torch step's measured peaks and TorchEngine.predict_memory gets names.

Why: in the first two-H100 torch step (2026-11-28) the engine's peak ran 168-201 MiB over the dry-run prediction
at ubatch 512 and 336 MiB at 2048 on every GPU, also where a GPU held no expert (-cmoe, op offload off). What the
probe named (torch_memory_probe_h100x2.md) is now charged by the dry run for real GPUs (docs/tuning.md).

    GPU:  python3 benchmarks/torch_memory_probe.py --plans cmoe-ts-1-1-nopo,ncmoe5-ts-1-1,ts-1-1-ub2048
    here: .venv/bin/python benchmarks/torch_memory_probe.py --cpu    (no GPU: checks the replay on a made-up
          trace, nothing measured)

Writes NAME.json and NAME.md (default torch_memory_probe) to --out (default $OUT, else benchmarks/results).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MiB = 1 << 20
OURS = "runtime/torch_engine/"


def alive_at_peak(trace: list[dict[str, Any]]) -> tuple[int, dict[int, dict[str, Any]]]:
    """(peak allocated bytes, the allocations alive at that moment by address) from one device's trace: 'alloc'
    adds, 'free_completed' removes (a free of a block allocated before the recording began is skipped)."""
    alive: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at = -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            alive[e["addr"]] = e
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in alive:
            total -= alive.pop(e["addr"])["size"]
        if total > peak:
            peak, at = total, i
    alive.clear()
    for e in trace[:at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = e
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    return peak, alive


def where(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """(the engine's innermost line that made it, the innermost frame of all) for an allocation's stack."""
    def name(f: dict[str, Any]) -> str:
        path = f["filename"]
        short = path[path.index(OURS):] if OURS in path else Path(path).name
        return f"{short}:{f['line']} {f['name']}"
    ours = next((name(f) for f in frames if OURS in f["filename"]), "(no engine frame)")
    return ours, name(frames[0]) if frames else "(no frame)"


def groups(alive: dict[int, dict[str, Any]], top: int = 15) -> dict[str, list[tuple[str, float, int]]]:
    """The bytes alive at the peak grouped by engine line and by innermost frame: [(where, MiB, count)]."""
    by_ours: Counter[str] = Counter()
    by_inner: Counter[str] = Counter()
    n_ours: Counter[str] = Counter()
    n_inner: Counter[str] = Counter()
    for e in alive.values():
        ours, inner = where(e.get("frames") or [])
        by_ours[ours] += e["size"]
        by_inner[inner] += e["size"]
        n_ours[ours] += 1
        n_inner[inner] += 1
    return {"engine_line": [(k, round(v / MiB, 1), n_ours[k]) for k, v in by_ours.most_common(top)],
            "innermost": [(k, round(v / MiB, 1), n_inner[k]) for k, v in by_inner.most_common(top)]}


def probe(name: str, cases: dict[str, Any], inv: Any, hw: Any, wl: Any) -> dict[str, Any]:
    import torch

    from runtime.torch_engine import TorchEngine
    import multi_gpu as mg
    engine = TorchEngine(device_map={g: f"cuda:{g[4:]}" for g in mg.GPUS}, weights="synthetic")
    plan = cases[name].plan
    pred = engine.predict_memory(inv, plan, hw, wl).to_dict()["devices"]
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=4_000_000)
    t0 = time.monotonic()
    try:
        m = engine.measure(inv, plan, wl)
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out: dict[str, Any] = {"plan": name, "ok": m.ok, "error": m.error, "seconds": round(time.monotonic() - t0, 1),
                           "ubatch": plan.knobs.n_ubatch, "devices": {}}
    parts = m.raw.get("static_parts") or {}
    context = m.raw.get("context_bytes") or {}
    for i, trace in enumerate(snap["device_traces"]):
        d = f"CUDA{i}"
        if not trace or d not in m.peak_bytes:
            continue
        peak, alive = alive_at_peak(trace)
        static = sum(int(v) for v in parts.get(d, {}).values())
        out["devices"][d] = {
            "engine_peak_mib": round(m.peak_bytes[d] / MiB, 1), "context_mib": round(context.get(d, 0) / MiB, 1),
            "replayed_peak_mib": round(peak / MiB, 1), "static_mib": round(static / MiB, 1),
            "predicted_mib": round(pred.get(d, {}).get("total", 0) / MiB, 1),
            "predicted_compute_mib": round(pred.get(d, {}).get("compute", 0) / MiB, 1),
            "alive_at_peak": groups(alive)}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def report(rows: list[dict[str, Any]], out: Path, name: str, meta: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "plans": rows}, indent=2))
    L = ["# The torch engine on real GPUs: what is allocated at each GPU's peak", "",
         f"{meta['date']}; {meta.get('gpu')}; torch {meta.get('torch')}. engine peak = max_memory_allocated + the "
         "CUDA context; replayed peak = the allocator history's own maximum (the context excluded); static = the "
         "accountant's weights + KV + staging; predicted = TorchEngine.predict_memory's total (context included) "
         "and its compute part.", ""]
    for r in rows:
        L += [f"## {r['plan']} (ubatch {r['ubatch']}, {r['seconds']} s{'' if r['ok'] else ', failed: ' + r['error']})",
              ""]
        for d, x in r["devices"].items():
            L += [f"### {d}: engine peak {x['engine_peak_mib']} MiB (context {x['context_mib']}), replayed peak "
                  f"{x['replayed_peak_mib']}, static {x['static_mib']}, predicted {x['predicted_mib']} (compute "
                  f"{x['predicted_compute_mib']})", "",
                  "| made by (engine line) | MiB | allocations |", "|---|---:|---:|"]
            L += [f"| `{k}` | {v} | {n} |" for k, v, n in x["alive_at_peak"]["engine_line"]]
            L += ["", "| innermost frame | MiB | allocations |", "|---|---:|---:|"]
            L += [f"| `{k}` | {v} | {n} |" for k, v, n in x["alive_at_peak"]["innermost"]]
            L.append("")
    (out / f"{name}.md").write_text("\n".join(L) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", default="cmoe-ts-1-1-nopo,ncmoe5-ts-1-1,ts-1-1-ub2048")
    ap.add_argument("--torch-layers", type=int, default=16)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--name", default="torch_memory_probe")
    ap.add_argument("--cpu", action="store_true", help="check the replay on a made-up trace (no GPU)")
    args = ap.parse_args(argv)
    if args.cpu:
        f = [{"filename": f"/x/{OURS}kernels.py", "line": 7, "name": "k"}]
        trace = [{"action": "alloc", "addr": 1, "size": 10, "frames": f},
                 {"action": "alloc", "addr": 2, "size": 30, "frames": f},
                 {"action": "free_completed", "addr": 1, "size": 10},
                 {"action": "free_completed", "addr": 99, "size": 5},
                 {"action": "alloc", "addr": 3, "size": 5, "frames": []}]
        peak, alive = alive_at_peak(trace)
        ok = peak == 40 and sorted(alive) == [1, 2] and where(f)[0] == f"{OURS}kernels.py:7 k"
        print("replay ok" if ok else f"replay WRONG: {peak} {sorted(alive)}")
        return 0 if ok else 1
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import torch

    import multi_gpu as mg
    inv = mg.torch_inventory(args.torch_layers)
    hw = mg.torch_hardware(mg.TORCH_HARDWARE)
    wl = mg.BenchRun(2048, 32, 0, 1)
    cases = {c.name: c for c in mg.torch_cases(inv, hw, [4, 8], wl)}
    wanted = [p for p in args.plans.split(",") if p]
    unknown = [p for p in wanted if p not in cases]
    if unknown:
        print(f"torch_memory_probe: unknown plan {unknown[0]!r}; one of {', '.join(cases)}", file=sys.stderr)
        return 2
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results")
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
            "gpu": ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
            "model": inv.name, "workload": "PP 2048 TG 32"}
    rows = []
    for p in wanted:
        rows.append(probe(p, cases, inv, hw, wl))
        report(rows, out, args.name, meta)
        print(f"{p}: " + "; ".join(f"{d} engine {x['engine_peak_mib']} predicted {x['predicted_mib']} MiB"
                                    for d, x in rows[-1]["devices"].items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
