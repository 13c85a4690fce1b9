"""How long a user waits for a measured answer (issue 41): the user's own command on one GPU, from its start to its
recommendation,

    offload-tuner tune MODEL --engine llamacpp --workload W --llama-server PATH --gpu B [--time-limit T]

per cell (B GiB, W a workload preset), on the Qwen3-30B-A3B-shaped Q4_K_M model written by our writer with a
vocabulary (K-quants, as users run them; sparse: the weights' values do not change a kernel's speed). The command
runs as a subprocess, as a user runs it, and its stderr lines are kept (the thread probe's, each served run's).

Resumable per device call: each cell is a study in WORKDIR/time_to_answer.db and its wall time is summed over the
calls in WORKDIR/state.json; a call that must end (--budget-s) stops the command with SIGINT (its resume line,
nothing lost), and the next call runs the same command, which goes on where it stopped (the serving included).

The check (`--full`): the study's serving again on a copy of its database (WORKDIR/full-CELL.db) with every
contender in 3 rounds, none screened or dropped, every filled twin (tuner.served.FULL), going on from the quick
path's own server runs (the same machine and -t: the same kind of sample), whose pick is the verdict the quick path
must match (`same_verdict`: the same pick, or one within the full run's spread of it: tuner.served.same_verdict).
Resumable as the cells are; a cell whose check has not ended says "not run".

Expected time on one H200 (Qwen3-30B-A3B shape, agent at 26-32k depth: a server run 60-120 s, llama-bench 10-30 s):
a cell's quick path about 2-4 min of search in --time-limit's first half, then 6-8 server runs in round 1 and 1-3
in round 2: 8-10 min in all; its full check 3 rounds x 7-10 contenders less the quick path's runs, 20-40 min (one
device call of 10 minutes per cell at least three times over).

Writes time_to_answer.json (cells[] with budget, workload, n_gpus, wall_s, explore_runs, served_runs, pick,
full_pick, same_verdict, threads) and time_to_answer.md to --out (default $OUT, else WORKDIR/report).

    GPU:  bash benchmarks/llamacpp_gpu.sh build-server build/llama.cpp-src.tar.gz
          python3 benchmarks/time_to_answer.py --cells 8:agent,12:rag --time-limit 9m --budget-s 480 [--full]
    CPU dry run: .venv/bin/python benchmarks/time_to_answer.py --cpu   (tiny model, the CPU builds, tiny workloads,
          the check included)
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


FULL_ROUNDS = 3


def full_check(cell: str, argv: list[str], workdir: Path, db: Path, budget_end: float, log) -> dict[str, Any]:
    """The cell's full confirmation on a copy of its study (the module docstring): its record, or {} when the call's
    budget ended first (the next call goes on)."""
    import shutil
    from dataclasses import replace

    import optuna

    from offload_tuner.app.tune import load_engine, tune_inputs
    from offload_tuner.cli import build_parser
    from offload_tuner.cli.tune import tune_options
    from planner.engine_registry import make_engine
    from tuner.records import StudyRecord
    from tuner.search import StudyConfig, Tuner
    from tuner.served import FULL, confirm_served, study_threads
    from tuner.setup import study_setup
    from tuner.storage import make_storage
    copy = workdir / f"full-{cell.replace(':', '-')}.db"
    first = not copy.exists()
    if first:
        shutil.copyfile(db, copy)
    req = replace(tune_options(build_parser().parse_args(argv[3:])), storage=f"sqlite:///{copy}")
    t = tune_inputs(req)
    engine = load_engine(req.engine_options(), t.hw)
    dialect = req.dialect or engine.dialect or "mainline"
    study = optuna.load_study(study_name=t.study, storage=make_storage(req.storage))
    stored = StudyRecord.of(study)
    if first:      # twins the quick path left out (under 256 MiB left) are made again; its rows are kept
        serving = dict(stored.serving or {})
        serving["fills"] = {k: v for k, v in (serving.get("fills") or {}).items() if v is not None}
        StudyRecord.save(study, serving=serving)
    setup = study_setup(engine, dialect, space=req.space, kv_types=req.kv_types, limits=req.space_limits,
                        probe=lambda: stored.threads_probe, confirm=req.confirm, serving=True)
    tuner = Tuner(t.inv, t.hw, engine, StudyConfig(
        model=req.model, objective=t.objective, bench=t.bench, dialect=dialect,
        n_ctx=req.ctx if req.ctx is not None else t.n_ctx, margin=t.margin, config=setup.config,
        study_name=t.study, storage=req.storage, seed=req.seed, pool_size=req.pool, requests=t.requests))
    server = make_engine(replace(req.engine_options(), engine="llamaserver"), t.hw)
    log(f"{cell}: the full check on {copy.name}: every contender, {FULL_ROUNDS} rounds, none dropped")
    return confirm_served(tuner.measurer, server, FULL_ROUNDS, drop_behind=None, thrift=FULL,
                          threads=study_threads(tuner.measurer), deadline=budget_end,
                          say=lambda line: log(f"{cell} full: {line}"))


def check_cell(cell: str, argv: list[str], workdir: Path, db: Path, state: dict[str, Any], budget_end: float,
               log) -> bool:
    """The full check of a cell whose quick path ended: full_pick and same_verdict into its row. True when done."""
    from tuner.served import same_verdict
    row = state[cell]
    t0 = time.monotonic()
    rec = full_check(cell, argv, workdir, db, budget_end, log)
    row["full_s"] = row.get("full_s", 0.0) + time.monotonic() - t0
    if not rec:
        return False
    pick = ((row.get("outcome") or {}).get("served") or {}).get("pick")
    row["full_pick"], row["same_verdict"] = rec.get("pick"), same_verdict(pick, rec)
    row["full_runs"] = sum(len(r["request_s"]["samples"]) + len(r["errors"]) for r in rec["results"])
    log(f"{cell}: full check: pick {row['full_pick']} ({row['full_runs']} runs): the quick pick {pick} is "
        f"{'the same verdict' if row['same_verdict'] else 'another verdict'}")
    return True


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
            "full_runs": row.get("full_runs"), "full_s": round(row["full_s"], 1) if row.get("full_s") else None,
            "goal_s": GOAL_S[1], "within_goal": bool(row.get("done")) and row.get("wall_s", 0) <= GOAL_S[1],
            "last_error": row.get("last_error"),
            "served_lines": len([ln for ln in row.get("lines", []) if re.match(r"# served \d+:", ln)])}


def report(state: dict[str, Any], out: Path, meta: dict[str, Any]) -> None:
    cells = [figures(c, r) for c, r in state.items()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "time_to_answer.json").write_text(json.dumps({"meta": meta, "cells": cells}, indent=1))
    lines = ["# Time to a measured answer (benchmarks/time_to_answer.py)", "",
             f"{meta.get('gpu') or 'CPU dry run'}; model {meta['model']}; {meta['date']}.", "",
             "| cell | wall s | calls | done | explore runs | served runs | pick | full pick | full runs | "
             "same verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['cell']} | {c['wall_s']:.0f} | {c['calls']} | {'yes' if c['done'] else 'no'} | "
                     f"{c['explore_runs']} | {c['served_runs']} | {c['pick']} | {c['full_pick'] or 'not run'} | "
                     f"{c['full_runs'] if c['full_runs'] is not None else '-'} | "
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
    ap.add_argument("--cpu", action="store_true", help="the dry run on the CPU builds and a tiny model (with --full)")
    ap.add_argument("--full", action="store_true", help="the check: each cell's full confirmation (3 rounds, every "
                    "contender) on a copy of its study, after its quick path")
    args = ap.parse_args()
    args.full = args.full or args.cpu
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
    budget_end = start + args.budget_s
    cells = args.cells.split(",")
    for cell in cells:               # every cell's quick path first: the checks take what is left
        if state.get(cell, {}).get("done"):
            continue
        if time.monotonic() >= budget_end - 5:
            left = True
            break
        argv = command(cell, model, bench, server, db, args)
        log(f"{cell}: {' '.join(argv[2:])}")
        if not run_cell(cell, argv, state, budget_end, log):
            left = True
        state_path.write_text(json.dumps(state, indent=1))
    for cell in cells if args.full else ():
        row = state.get(cell, {})
        if not row.get("done") or "same_verdict" in row:
            continue
        if time.monotonic() >= budget_end - 5 or not check_cell(
                cell, command(cell, model, bench, server, db, args), workdir, db, state, budget_end, log):
            left = True
        state_path.write_text(json.dumps(state, indent=1))
    report(state, Path(args.out) if args.out else workdir / "report", meta)
    return 3 if left else 0


if __name__ == "__main__":
    sys.exit(main())
