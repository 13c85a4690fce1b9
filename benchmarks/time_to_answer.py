"""How long a user waits for a measured answer (issue 41): the user's own command on one GPU, from its start to its
recommendation,

    offload-tuner tune MODEL --engine llamacpp --workload W --llama-server PATH --gpu B [--time-limit T]

per cell (B GiB, W a workload preset), on the Qwen3-30B-A3B-shaped Q4_K_M model written by our writer with a
vocabulary (K-quants, as users run them; sparse: the weights' values do not change a kernel's speed). The command
runs as a subprocess, as a user runs it, and its stderr lines are kept (the thread probe's, each served run's).

Resumable per device call: each cell is a study in WORKDIR/time_to_answer.db and its wall time is summed over the
calls in WORKDIR/state.json; a call that must end (--budget-s) stops the command with SIGINT (its resume line,
nothing lost), and the next call runs the same command, which goes on where it stopped (the serving included).

The check (`--full`): the study's serving again on a copy of its database with every contender in 3 rounds and
none dropped, whose pick is the verdict the quick path must match (`same_verdict`: the same pick, or one within
the full run's spread of it). Not run where no device time is left: the row says so.

Writes time_to_answer.json (cells[] with budget, workload, n_gpus, wall_s, explore_runs, served_runs, pick,
full_pick, same_verdict, threads) and time_to_answer.md to --out (default $OUT, else WORKDIR/report).

    GPU:  bash benchmarks/llamacpp_gpu.sh build-server build/llama.cpp-src.tar.gz
          python3 benchmarks/time_to_answer.py --cells 8:agent,12:rag --time-limit 9m --budget-s 480
    CPU dry run: .venv/bin/python benchmarks/time_to_answer.py --cpu   (tiny model, the CPU builds, tiny workloads)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_WORKDIR = ROOT / "benchmarks" / "results" / "time_to_answer"
PRESET = "Qwen3-30B-A3B:Q4_K_M"
GOAL_S = {1: 600, 2: 900}          # the goal: a recommendation within 10 minutes on one GPU, 15 on two


def write_model(workdir: Path, cpu: bool) -> Path:
    from planner.presets import load_preset
    from runtime.synth import tiny_spec, uniform_recipe, write_gguf
    path = workdir / ("tiny.gguf" if cpu else "qwen3-30b-a3b-shape-q4_k_m.gguf")
    if not path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        if cpu:
            write_gguf(path, tiny_spec("qwen3moe", n_layer=6, n_expert=8, n_expert_used=2), uniform_recipe("Q4_K"),
                       vocab=True)
        else:
            p = load_preset(PRESET)
            write_gguf(path, p.spec, p.type_of, sparse=True, name="synthetic-Qwen3-30B-A3B-Q4_K_M", vocab=True)
    return path


def binaries(cpu: bool) -> tuple[Path, Path]:
    """(llama-bench, llama-server): the CUDA builds of llamacpp_gpu.sh, or the CPU ones of the tests."""
    if cpu:
        from runtime.llamacpp_build import ensure_built
        from runtime.server_process import server_binary
        return ensure_built()["llama-bench"], server_binary("mainline")
    build = ROOT / "benchmarks" / "results" / "llamacpp_gpu" / "llama.cpp-cuda" / "build" / "bin"
    return build / "llama-bench", build / "llama-server"


def command(cell: str, model: Path, bench: Path, server: Path, db: Path, args: argparse.Namespace) -> list[str]:
    gib, workload = cell.split(":")
    if args.cpu:                    # a workload of the preset's name that a tiny model on the CPU answers fast
        workload = str(_cpu_workload(db.parent, workload))
    argv = [sys.executable, "-m", "offload_tuner.cli", "tune", str(model), "--engine", "llamacpp",
            "--llama-bench", str(bench), "--workload", workload, "--llama-server", str(server), "--gpu", f"{gib}GiB",
            "--study", cell.replace(":", "-"), "--storage", f"sqlite:///{db}", "--json", "--no-report"]
    if args.time_limit:
        argv += ["--time-limit", args.time_limit]
    if args.cpu:                    # the CPU dry run: every plan on the CPU, tiny runs, a workload it answers fast
        argv += ["--cpu-stand-in", "--keep-free", "0", "--trials", "3", "--n-prompt", "16", "--n-gen", "4",
                 "--reps", "1", "--pool", "20"]
    return argv


def _cpu_workload(workdir: Path, name: str) -> Path:
    path = workdir / f"{name}.toml"
    path.write_text(f'name = "{name}"\n[[request]]\nnew_tokens = 32\ncached_tokens = 64\ngen_tokens = 8\n')
    return path


def run_cell(cell: str, argv: list[str], state: dict[str, Any], budget_end: float, log) -> bool:
    """The user's command, until it ends or the call's budget does (SIGINT: its resume line, nothing lost).
    True when it ended with a recommendation."""
    row = state.setdefault(cell, {"wall_s": 0.0, "calls": 0, "lines": []})
    row["calls"] += 1
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, budget_end - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)        # as a user's Ctrl-C: the study keeps every finished run
        out, err = proc.communicate()
    row["wall_s"] += time.monotonic() - t0
    row["lines"] += [ln for ln in err.splitlines() if ln.startswith("#") or "error" in ln]
    log(f"{cell}: rc {proc.returncode} after {time.monotonic() - t0:.0f} s ({row['wall_s']:.0f} s in all)")
    if proc.returncode == 0 and out.strip():
        row["outcome"] = json.loads(out)
        row["done"] = True
    else:
        row["last_error"] = err.strip().splitlines()[-1] if err.strip() else f"rc {proc.returncode}"
    return bool(row.get("done"))


def figures(cell: str, row: dict[str, Any]) -> dict[str, Any]:
    """The cell's JSON row from its stored state."""
    gib, workload = cell.split(":")
    o = row.get("outcome") or {}
    served = o.get("served") or {}
    runs = o.get("engine_runs") or {}
    probe = [ln for ln in row.get("lines", []) if ln.startswith("# threads")]
    return {"cell": cell, "budget": f"{gib} GiB", "workload": workload, "n_gpus": 1,
            "wall_s": round(row.get("wall_s", 0.0), 1), "calls": row.get("calls", 0), "done": bool(row.get("done")),
            "explore_runs": (runs.get("trials") or 0) + (runs.get("baselines") or 0) if runs else None,
            "served_runs": sum(len(r.get("request_s", {}).get("samples", [])) + len(r.get("errors", []))
                               for r in served.get("results", [])) if served else None,
            "pick": served.get("pick"), "headline": o.get("headline"), "threads": o.get("threads"),
            "threads_probe_lines": probe, "full_pick": row.get("full_pick"), "same_verdict": row.get("same_verdict"),
            "goal_s": GOAL_S[1], "within_goal": bool(row.get("done")) and row.get("wall_s", 0) <= GOAL_S[1],
            "last_error": row.get("last_error"),
            "served_lines": len([ln for ln in row.get("lines", []) if re.match(r"# served \d+:", ln)])}


def report(state: dict[str, Any], out: Path, meta: dict[str, Any]) -> None:
    cells = [figures(c, r) for c, r in state.items()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "time_to_answer.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    lines = ["# Time to a measured answer (benchmarks/time_to_answer.py)", "",
             f"{meta.get('gpu') or 'CPU dry run'}; model {meta['model']}; {meta['date']}.", "",
             "| cell | wall s | calls | done | explore runs | served runs | pick | full pick | same verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['cell']} | {c['wall_s']:.0f} | {c['calls']} | {'yes' if c['done'] else 'no'} | "
                     f"{c['explore_runs']} | {c['served_runs']} | {c['pick']} | {c['full_pick'] or 'not run'} | "
                     f"{c['same_verdict'] if c['same_verdict'] is not None else 'not run'} |")
    for c in cells:
        lines += ["", f"## {c['cell']}", "", f"- headline: {c['headline']}", f"- threads: {c['threads']}",
                  *(f"- {ln}" for ln in c["threads_probe_lines"]),
                  *([f"- last error: {c['last_error']}"] if c["last_error"] and not c["done"] else [])]
    (out / "time_to_answer.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="8:agent,12:agent,8:rag,12:rag")
    ap.add_argument("--time-limit", help="passed to tune (the user's --time-limit)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="this call's seconds for every cell together")
    ap.add_argument("--workdir", default=str(DEFAULT_WORKDIR))
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--cpu", action="store_true", help="the dry run on the CPU builds and a tiny model")
    args = ap.parse_args()
    start = time.monotonic()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    state_path = workdir / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - start:6.0f} s] {msg}", flush=True)
    model = write_model(workdir, args.cpu)
    bench, server = binaries(args.cpu)
    db = workdir / "time_to_answer.db"
    from runtime.gpumem import gpu_summary
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": f"{PRESET} shape ({model.name})",
            "gpu": None if args.cpu else gpu_summary(), "time_limit": args.time_limit, "cores": os.cpu_count()}
    left = False
    for cell in args.cells.split(","):
        if state.get(cell, {}).get("done"):
            continue
        budget_end = start + args.budget_s
        if time.monotonic() >= budget_end - 5:
            left = True
            break
        log(f"{cell}: {' '.join(command(cell, model, bench, server, db, args)[2:])}")
        if not run_cell(cell, command(cell, model, bench, server, db, args), state, budget_end, log):
            left = True
        state_path.write_text(json.dumps(state, indent=1))
    report(state, Path(args.out) if args.out else workdir / "report", meta)
    return 3 if left else 0


if __name__ == "__main__":
    sys.exit(main())
