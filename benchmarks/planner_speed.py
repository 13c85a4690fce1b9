"""Planner speed: `inspect`, `plan`, `explain` on preset DeepSeek-V3 (1,000+ tensors), in-process and as the CLI,
and header reading of a sparse ~400 GB split GGUF. Median wall times over repetitions.

Goals (issue "Planner core"): plan in-process < 0.2 s; every CLI command and the split header read < 1 s.
Writes benchmarks/results/planner_speed.{json,md}.

    .venv/bin/python benchmarks/planner_speed.py [--reps 7]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload_tuner.cli import main as cli_main  # noqa: E402
from planner.gguf_header import load_inventory, read_header  # noqa: E402
from planner.hardware import from_gpu_sizes  # noqa: E402
from planner.plan import Knobs  # noqa: E402
from planner.presets import load_preset  # noqa: E402
from planner.propose import best_plans  # noqa: E402

MODEL = "preset:DeepSeek-V3:Q4_K_M"
EXPLAIN_ARGS = ["-ngl", "99", "-ot", r"blk\.(3|4|5)\.ffn_.*_exps=CUDA0", "-ot", "exps=CPU", "-c", "16384",
                "-ub", "2048", "-b", "4096"]


def timed(fn, reps: int) -> dict:
    fn()   # warm-up: imports, caches
    xs = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "reps": reps}


def cli_subprocess(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "offload_tuner.cli", *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"offload-tuner {' '.join(args)} failed: {r.stderr.strip()}")


def in_process(args: list[str]) -> None:
    import contextlib
    import io
    with contextlib.redirect_stdout(io.StringIO()):
        if cli_main(args) != 0:
            raise RuntimeError(f"offload-tuner {' '.join(args)} failed")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    from runtime.synth import write_gguf

    rows: dict[str, dict] = {}
    preset = load_preset("DeepSeek-V3:Q4_K_M")
    inv = preset.inventory()
    hw = from_gpu_sizes("24GiB")
    rows["plan (in-process: propose + score, DeepSeek-V3, 24 GiB)"] = timed(
        lambda: best_plans(inv, hw, Knobs(n_ctx=16384)), args.reps) | {"goal_s": 0.2}
    rows["inspect (in-process)"] = timed(lambda: in_process(["inspect", MODEL]), args.reps) | {"goal_s": 1.0}
    goal = {"goal_s": 1.0}
    rows["plan (in-process CLI incl. flags)"] = \
        timed(lambda: in_process(["plan", MODEL, "--gpu", "24GiB"]), args.reps) | goal
    rows["explain (in-process CLI)"] = \
        timed(lambda: in_process(["explain", MODEL, "--", *EXPLAIN_ARGS]), args.reps) | goal
    for name, cmd in (("inspect", ["inspect", MODEL]), ("plan", ["plan", MODEL, "--gpu", "24GiB"]),
                      ("explain", ["explain", MODEL, "--", *EXPLAIN_ARGS])):
        rows[f"{name} (CLI process, incl. interpreter start)"] = \
            timed(lambda c=cmd: cli_subprocess(c), max(3, args.reps // 2)) | goal
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "DeepSeek-V3-Q4_K_M.gguf"
        shards = write_gguf(path, preset.spec, preset.type_of, sparse=True, split_max_bytes=80 << 30,
                            name="DeepSeek-V3 sparse")
        logical = sum(p.stat().st_size for p in shards)
        rows[f"read_header, sparse split GGUF ({len(shards)} shards, {logical / 1e9:.0f} GB)"] = timed(
            lambda: read_header(shards[0]), args.reps) | {"goal_s": 1.0}
        rows["load_inventory of the same split GGUF"] = timed(lambda: load_inventory(shards[0]), args.reps) | goal
        rows["inspect of the split GGUF (CLI process)"] = \
            timed(lambda: cli_subprocess(["inspect", str(shards[0])]), 3) | goal

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
            "n_tensors": len(inv.tensors)}
    (out / "planner_speed.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    lines = ["# Planner speed", "", f"{meta}", "", "| what | median s | min s | max s | goal s | ok |",
             "|---|---|---|---|---|---|"]
    for k, v in rows.items():
        ok = "yes" if v["median_s"] < v["goal_s"] else "NO"
        lines.append(f"| {k} | {v['median_s']:.3f} | {v['min_s']:.3f} | {v['max_s']:.3f} | {v['goal_s']} | {ok} |")
    (out / "planner_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(v["median_s"] < v["goal_s"] for v in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
