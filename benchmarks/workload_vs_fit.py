"""What the user runs, against the best `--fit` they could run (issue "tune what the user runs"): per VRAM budget and
workload preset, a study under the time objective (the workload's mean request time) on the synthetic
Qwen3-30B-A3B-shaped Q4_0 model of benchmarks/llamacpp_gpu.py, whose finalists and `llama-server --fit on` at
ubatch 512, 2048 and 4096 are then served as llama-server on the workload itself, interleaved in rounds
(tuner/served.py). The reference is the fastest --fit variant; the recommendation is the fastest of all
within the budget, the references included, so it is never slower than what the user would have run.

Explore: `--explore sim` (default) screens and searches with the cost model calibrated on the H100 box
(tests/planner/data/h100_calibrate_20261124.json) and a 256 MiB margin (llama-bench's memory-error prior), which
needs no GPU: run it here first (`--prepare`) and carry the study database; `--explore llamacpp` searches with the
real llama-bench on the GPU (costs device time). Every served number comes from llama-server on the GPU.

Writes NAME.json, NAME.md and NAME.png (default workload_vs_fit) to --out (default $OUT, else <workdir>/report):
per cell the reference's flags, its mean request time [spread], ours, the speedup with its verdict, both times to
first token, both VRAM peaks, llama-bench against llama-server for each finalist, the engine runs used, and the
goal (rag >= 1.3x, agent >= 1.15x, chat >= 1.0x). Resumable across 10-minute device calls: each cell is an Optuna
study in <workdir>/workload_vs_fit.db and each served sample is stored as it comes; a call starts no sample that
would end past --time-budget (exit 3 while work is left, 0 when every cell is served).

    here:  .venv/bin/python benchmarks/workload_vs_fit.py --prepare --cells 6:rag,6:agent,6:chat,12:rag,12:agent,12:chat
    GPU:   python3 benchmarks/workload_vs_fit.py --cells 6:rag,6:agent --time-budget 500
           (after `bash benchmarks/llamacpp_gpu.sh build-server TARBALL`; carry .whl and the workdir's database)
    CPU dry run: .venv/bin/python benchmarks/workload_vs_fit.py --cpu   (tiny model, CPU llama-server, tiny workloads)

Threads: `--serve-threads N` serves every contender, --fit too, at -t N. On a machine whose default thread count is
not its best (a 64-vCPU four-GPU VM: TG 20x slower at its default -t 64 than at 32, docs/llamacpp.md section 13),
measure first with benchmarks/threads_sweep.py (its last line is the best count) and pass that.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from planner.gguf_header import load_inventory  # noqa: E402
from planner.hardware import GiB, MiB, load_hardware  # noqa: E402
from tuner.objectives import bench_for  # noqa: E402
from tuner.served import confirm_served, headline  # noqa: E402
from tuner.records import StudyRecord  # noqa: E402
from tuner.search import Tuner, StudyConfig  # noqa: E402
from tuner.setup import study_setup  # noqa: E402
from planner.workload import RequestClass, Workload, preset  # noqa: E402

DEFAULT_WORKDIR = ROOT / "benchmarks" / "results" / "workload_vs_fit"
H100_PROFILE = ROOT / "tests" / "planner" / "data" / "h100_calibrate_20261124.json"
MODEL_REL = "model/qwen3-30b-a3b-shape-q4_0.gguf"     # the default shape's model_rel: the same path everywhere
GOALS = {"rag": 1.3, "agent": 1.15, "chat": 1.0, "batch": 1.0}
EXPLORE_MARGIN = 256 * MiB       # llama-bench's memory-error prior (planner/engine_registry.py), for a sim search
# the dry run: request classes a tiny CPU model answers in well under a second each
CPU_WORKLOADS = {"rag": Workload("rag", (RequestClass(96, 0, 8),)),
                 "agent": Workload("agent", (RequestClass(32, 64, 8), RequestClass(48, 96, 8))),
                 "chat": Workload("chat", (RequestClass(24, 0, 12), RequestClass(24, 64, 12)))}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Cell:
    """A budget of `gibs[i]` GiB on GPU i (one GPU, several alike, or cards of different sizes), served
    `workload`."""
    gibs: tuple[int, ...]
    workload: str

    @property
    def n_gpus(self) -> int:
        return len(self.gibs)

    @property
    def size(self) -> str:
        """"12", "2x8" (GPUs alike) or "24+16+16+8" (cards of different sizes)."""
        if len(set(self.gibs)) > 1:
            return "+".join(map(str, self.gibs))
        return str(self.gibs[0]) if self.n_gpus == 1 else f"{self.n_gpus}x{self.gibs[0]}"

    @property
    def label(self) -> str:
        return f"{self.size} GiB"

    def name(self, series: str, model_tag: str = "") -> str:
        return "-".join(x for x in ("wvf", model_tag, f"{self.size}g", self.workload, series) if x)

    def budgets(self) -> dict[str, int]:
        return {f"CUDA{i}": g * GiB for i, g in enumerate(self.gibs)}


def parse_cells(text: str) -> list[Cell]:
    """"GIB:WORKLOAD" (one GPU), "NxGIB:WORKLOAD" (N GPUs of GIB each) or "G0+G1+...:WORKLOAD" (GPU i has Gi GiB),
    comma-separated."""
    out = []
    for part in text.split(","):
        size, _, w = part.strip().partition(":")
        n, x, gib = size.rpartition("x")
        gibs = size.split("+") if "+" in size else [gib] * (int(n) if x and n.isdigit() else 1)
        if w not in GOALS or not all(g.isdigit() and int(g) >= 1 for g in gibs) or (x and not n.isdigit()) \
                or (x and "+" in size) or not gibs:
            raise SystemExit(f"workload_vs_fit: --cells {text!r}: give GIB:WORKLOAD, NxGIB:WORKLOAD or "
                             f"G0+G1+...:WORKLOAD pairs, WORKLOAD one of {', '.join(GOALS)}")
        out.append(Cell(tuple(int(g) for g in gibs), w))
    return out


def model_rel(preset_name: str) -> str:
    """The model's path under the workdir: the 30B shape's as the stored studies have it, else one per shape."""
    shape = preset_name.split(":")[0].lower()
    return f"model/{shape}-shape-q4_0.gguf"


def model_tag(preset_name: str) -> str:
    """What a study's name adds for a model other than the default shape ("" for it: the stored names)."""
    import llamacpp_gpu
    if preset_name == llamacpp_gpu.PRESET:
        return ""
    return preset_name.split(":")[0].lower().replace("qwen3-", "")


def workload_of(name: str, cpu: bool) -> Workload:
    return CPU_WORKLOADS[name] if cpu else preset(name)


def model_path(args, workdir: Path) -> Path:
    """The model: a sparse file of the right header with --prepare (the study needs its inventory only), the
    written Q4_0 model otherwise (benchmarks/llamacpp_gpu.write_model; tiny with --cpu)."""
    import llamacpp_gpu
    rel = Path(os.path.relpath(workdir, ROOT)) / model_rel(args.preset)
    path = ROOT / rel
    if args.cpu:
        path = path.with_name("tiny-qwen3moe-q4_0.gguf")
    if not path.exists():
        if args.prepare:
            from planner.presets import load_preset
            from runtime.synth import uniform_recipe, write_gguf
            path.parent.mkdir(parents=True, exist_ok=True)
            write_gguf(path, load_preset(args.preset).spec, uniform_recipe(llamacpp_gpu.QUANT), sparse=True,
                       name=f"synthetic-{args.preset.split(':')[0]}-{llamacpp_gpu.QUANT}", vocab=True)
        else:
            llamacpp_gpu.write_model(path, tiny=args.cpu, preset=args.preset, vocab=True)
    return path


def tuner_for(args, inv, hw0, cell: Cell, bench_engine) -> Tuner:
    """A cell's study: explored by `bench_engine` (llama-bench), or by the sim engine on the cell's budget (its
    GPUs: the profile's GPU repeated)."""
    from runtime.sim import SimEngine
    w = workload_of(cell.workload, args.cpu)
    hw = hw0.with_vram([g * GiB for g in cell.gibs])
    explore_engine = bench_engine if bench_engine is not None else SimEngine(hw)
    bench = bench_for(w, repetitions=1 if args.cpu else 3)
    ctx = -(-w.ctx // 256) * 256
    threads = 0 if args.threads == 0 else hw.host.n_threads         # 0: the plans carry no -t
    config = study_setup(explore_engine, "mainline", space="settled", threads=threads).config   # as `tune`, at -t
    return Tuner(inv, hw, explore_engine, StudyConfig(
        model=str(inv.source), objective="time", bench=bench, requests=w, n_ctx=ctx,
        margin=EXPLORE_MARGIN if args.explore == "sim" else None, config=config,
        study_name=cell.name(args.series, model_tag(args.preset)), storage=args.storage, seed=0, pool_size=60))


def explore(args, inv, hw0, cells, bench_engine) -> None:
    for cell in cells:
        t = tuner_for(args, inv, hw0, cell, bench_engine)
        if StudyRecord.of(t.study).explored:
            continue
        log(f"{t.study_name}: exploring with the {args.explore} engine, {args.trials} runs")
        res = t.run(args.trials)
        StudyRecord.save(t.study, explored=True)
        log(f"{t.study_name}: explored ({res.measured} runs, {res.stopped or 'done'})")


def serve(args, inv, hw0, cells, deadline: float, server, bench_engine, checkpoint=None) -> bool:
    finished = True
    for cell in cells:
        t = tuner_for(args, inv, hw0, cell, bench_engine)
        if time.monotonic() >= deadline:
            finished = False
            break
        # a cell served before the finalists had filled twins gets them now (the rows it has are kept)
        log(f"{t.study_name}: serving the references, {args.finalists} finalists and their filled twins, "
            f"{args.rounds} rounds")
        rec = confirm_served(t.measurer, server, rounds=args.rounds, n_finalists=args.finalists, deadline=deadline,
                             threads=args.serve_threads,
                             progress=(lambda done, total: checkpoint()) if checkpoint else None)
        if not rec:
            log(f"{t.study_name}: stopped before the deadline: run again")
            finished = False
            break
        log(headline(rec))
        if checkpoint is not None:
            checkpoint()
    return finished


def split_words(command: str | None, inv, n_gpus: int) -> str | None:
    """How a served command shares the model out over several GPUs (planner.residency.gpu_shares), or None: one
    GPU, no model to read, or a --fit that moves experts itself at load (its share is the VRAM it used)."""
    if not command or inv is None or n_gpus < 2:
        return None
    from planner.errors import InputError
    from planner.flags import parse
    from planner.residency import gpu_shares
    try:
        parsed = parse(command, inv, "mainline", tool="server", n_gpus=n_gpus)
    except InputError:
        return None
    if parsed.fit_moves_experts:
        return None
    return "; ".join(s.words() for s in gpu_shares(inv, parsed.to_plan(inv.name)).values())


def cell_row(study, cell: Cell, inv=None) -> dict[str, Any]:
    from tuner.served import partial_record, waiting_finalists
    attrs = StudyRecord.of(study)
    rec = attrs.served or partial_record(attrs, cell.budgets()) or {}
    res = {r["key"]: r for r in rec.get("results", [])}
    ref, pick = res.get(rec.get("reference") or ""), res.get(rec.get("pick") or "")
    serving = attrs.serving or {}

    def side(r: dict[str, Any] | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {"name": r["name"], "command": r.get("command"), "request_s": r["request_s"], "ttft_s": r["ttft_s"],
                "pp": r["pp"]["median"], "tg": r["tg"]["median"],
                "vram_mib": {d: b / MiB for d, b in r["vram_device_bytes"].items()},
                "bench": r.get("bench"), "bench_vs_server": r.get("bench_vs_server", [])}
    # the tuner's fastest finalist (a twin included), set beside the reference even where the pick is a --fit
    finalists = [x for x in rec.get("results", []) if "finalist" in x["roles"] and x["request_s"]["samples"]]
    best = min(finalists, key=lambda x: x["request_s"]["median"], default=None)
    waiting = waiting_finalists(rec) if rec else []
    speed = (ref["request_s"]["median"] / pick["request_s"]["median"]) if ref and pick and not waiting else None
    gib = cell.gibs[0] if len(set(cell.gibs)) == 1 else list(cell.gibs)
    return {"budget_gib": gib, "n_gpus": cell.n_gpus, "budget": cell.label, "workload": cell.workload,
            "study": study.study_name,
            "served": bool(rec) and not rec.get("partial"), "partial": bool(rec.get("partial")),
            "waiting": waiting,
            "explore_runs": sum(1 for t in study.trials if t.state.name == "COMPLETE"),
            "served_runs": len(serving.get("rows", [])), "reference": side(ref), "pick": side(pick),
            "best_finalist": side(best), "budget_mib": {d: b / MiB for d, b in (rec.get("budget_bytes") or {}).items()},
            "speedup": speed, "verdict": (rec.get("speedup") or {}).get("verdict"), "goal": GOALS[cell.workload],
            "headline": headline(rec) if rec else None, "gives_up": rec.get("gives_up", []),
            "results": [dict(x, split=split_words(x.get("command"), inv, cell.n_gpus))
                        for x in rec.get("results", [])]}


def write_report(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "cells": rows}, indent=2, default=str))
    L = ["# What the user runs: llama-server on the workload, against the best --fit", "",
         f"{meta['date']}; {meta.get('gpu') or 'no GPU (CPU dry run)'}; model {meta['model']}; explored with the "
         f"{meta['explore']} engine ({meta['trials']} runs a cell), then the references (llama-server --fit on at -ub "
         f"512, 2048, 4096) and {meta['finalists']} finalists with their filled twins (a finalist's plan with experts "
         "moved onto the GPU up to what its server left of the budget) served on the workload, "
         f"{meta['rounds']} interleaved rounds (the note says which machine ran which rows). Times are medians "
         "[min-max] of the workload's mean request time; the speedup is the reference's over ours, 'tie' when inside "
         "the spreads of the request rates.", "",
         "| budget | workload | reference | its time s | ours | our time s | speedup | goal | TTFT ref / ours s "
         "| VRAM MiB ref / ours | runs (explore + served) |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]

    def t(s: dict[str, Any]) -> str:
        return f"{s['median']:.2f} [{s['lo']:.2f}-{s['hi']:.2f}]"
    for r in rows:
        ref, pick = r["reference"], r["pick"]
        if r["waiting"]:
            L.append(f"| {r['budget']} | {r['workload']} | {ref['name'] if ref else '-'} | "
                     f"{t(ref['request_s']) if ref else '-'} | - | - | partial: no finalist served yet | "
                     f"{r['goal']}x | - | - | {r['explore_runs']} + {r['served_runs']} |")
            continue
        if not (ref and pick):
            L.append(f"| {r['budget']} | {r['workload']} | - | - | - | - | not served yet | "
                     f"{r['goal']}x | - | - | {r['explore_runs']} + {r['served_runs']} |")
            continue
        met = "met" if r["speedup"] >= r["goal"] else f"short by {r['goal'] - r['speedup']:.2f}"
        if r["partial"]:
            met += f" (partial: {r['served_runs']} of the rounds' runs)"
        L.append(f"| {r['budget']} | {r['workload']} | {ref['name']} | {t(ref['request_s'])} | "
                 f"{pick['name']} | {t(pick['request_s'])} | {r['speedup']:.2f}x {r['verdict']} | "
                 f"{r['goal']}x: {met} | "
                 f"{ref['ttft_s']['median']:.2f} / {pick['ttft_s']['median']:.2f} | "
                 f"{sum(ref['vram_mib'].values()):.0f} / {sum(pick['vram_mib'].values()):.0f} | "
                 f"{r['explore_runs']} + {r['served_runs']} |")
    vs = [(r, r["reference"], r["best_finalist"]) for r in rows
          if r.get("reference") and r.get("best_finalist") and not r["waiting"]]
    if vs:
        L += ["", "The tuner's fastest finalist against the reference (x: ours over --fit, > 1 better for us; VRAM MiB "
              "per GPU, ours / --fit / the budget):", ""]
        for r, ref, fin in vs:
            gpus = sorted(set(fin["vram_mib"]) | set(ref["vram_mib"]))
            vram = ", ".join(f"{d} {fin['vram_mib'].get(d, 0):,.0f} / {ref['vram_mib'].get(d, 0):,.0f} / "
                             f"{r['budget_mib'].get(d, 0):,.0f}" for d in gpus)
            L.append(f"- {r['budget']} {r['workload']}: {fin['name']}: request "
                     f"{ref['request_s']['median'] / fin['request_s']['median']:.2f}x, TTFT "
                     f"{ref['ttft_s']['median'] / fin['ttft_s']['median']:.2f}x, PP {fin['pp'] / ref['pp']:.2f}x, "
                     f"TG {fin['tg'] / ref['tg']:.2f}x; {vram}")
    L += ["", "First lines (what the report of each study says first):", ""]
    L += [f"- {r['budget']} {r['workload']}: {r['headline']}" for r in rows if r["headline"]]
    L += ["", "Commands served (llama-server):", ""]
    for r in rows:
        for role in ("reference", "pick"):
            if r[role] and r[role].get("command") and not (role == "pick" and r["waiting"]):
                L.append(f"- {r['budget']} {r['workload']}, {role}: `{r[role]['command']}`")
    warn = [(r, x) for r in rows for x in r["results"] if x.get("bench_vs_server")]
    if warn:
        study_engine = "the sim engine: the calibrated models" if meta["explore"] == "sim" else "llama-bench"
        L += ["", f"The study's runs ({study_engine}) against llama-server (more than 5% apart; the budget is judged "
              "on the server's):", ""]
        for r, x in warn:
            line = "; ".join(x["bench_vs_server"])
            if meta["explore"] == "sim":       # records served before 2026-11-27 17:00 call any study run llama-bench
                line = line.replace("llama-bench ", "sim ")
            L.append(f"- {r['budget']} {r['workload']} {x['name']}: {line}")
    L += ["", "Every contender (median mean request time s, TTFT s, PP / TG t/s, VRAM MiB (per GPU), how several GPUs "
          "share the model (a --fit chooses at load: its VRAM says), failures):", ""]
    for r in rows:
        for x in r["results"]:
            rs = x["request_s"]
            vram = x["vram_device_bytes"]
            per_gpu = f" ({' + '.join(f'{vram[d] / MiB:.0f}' for d in sorted(vram))})" if len(vram) > 1 else ""
            got = (f"{rs['median']:.2f} s, TTFT {x['ttft_s']['median']:.2f}, PP {x['pp']['median']:.0f} / TG "
                   f"{x['tg']['median']:.1f}, {sum(vram.values()) / MiB:.0f} MiB{per_gpu}"
                   if rs["samples"] else "no sample")
            failed = f"; failed: {x['errors'][0][:160]}" if x["errors"] else ""
            failed += f"; not served again: {x['dropped']:.2f}x behind" if x.get("dropped") else ""
            split = f"; split: {x['split']}" if x.get("split") else ""
            L.append(f"- {r['budget']} {r['workload']} {x['name']}: {got}{split}{failed}")
    if meta.get("note"):
        L += ["", meta["note"]]
    (out / f"{name}.md").write_text("\n".join(L) + "\n")
    plot(rows, out / f"{name}.png")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in rows if r["reference"] and r["pick"] and not r.get("waiting")]
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(done) + 2), 4))
    xs = range(len(done))
    for off, role, label in ((-0.2, "reference", "best --fit"), (0.2, "pick", "offload-tuner")):
        med = [r[role]["request_s"]["median"] for r in done]
        err = [[m - r[role]["request_s"]["lo"] for m, r in zip(med, done)],
               [r[role]["request_s"]["hi"] - m for m, r in zip(med, done)]]
        ax.bar([x + off for x in xs], med, 0.4, yerr=err, label=label)
    ax.set_xticks(list(xs), [f"{r['budget']}\n{r['workload']}" for r in done])
    ax.set_ylabel("mean request time (s), llama-server")
    if done:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args, cells, meta: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """The report of the cells, and a gzipped copy of the study database beside it (NAME_state.db.gz: the served
    samples a later machine resumes from, `gunzip -c OUT/NAME_state.db.gz > <workdir>/workload_vs_fit.db`)."""
    import optuna
    from tuner.storage import make_storage, sqlite_path
    from tune_vs_fit import save_state
    storage = make_storage(args.storage)
    names = {s.study_name for s in storage.get_all_studies()}
    tag = model_tag(args.preset)
    model = sqlite_path(args.storage).parent / model_rel(args.preset)
    inv = load_inventory(model) if not args.cpu and model.exists() else None      # for the several-GPU splits
    rows = [cell_row(optuna.load_study(study_name=c.name(args.series, tag), storage=storage), c, inv)
            for c in cells if c.name(args.series, tag) in names]
    write_report(rows, meta, out, args.name)
    save_state(sqlite_path(args.storage), out / f"{args.name}_state.db.gz")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="6:rag,6:agent,6:chat,12:rag,12:agent,12:chat",
                    help="GIB:WORKLOAD pairs (default the issue's six)")
    ap.add_argument("--explore", choices=("sim", "llamacpp"), default="sim")
    ap.add_argument("--trials", type=int, default=24, help="explore runs a cell (default 24)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved served rounds (default 2)")
    ap.add_argument("--finalists", type=int, default=2, help="finalists served beside the references (default 2)")
    ap.add_argument("--prepare", action="store_true", help="explore only (sim: on this machine, no GPU), for the "
                    "database to carry")
    ap.add_argument("--cpu", action="store_true", help="dry run: tiny model, CPU llama-server, tiny workloads")
    ap.add_argument("--server", type=Path, help="llama-server (default <llamacpp_gpu workdir>/llama.cpp-cuda/build/"
                    "bin/llama-server; with --cpu the CPU build)")
    ap.add_argument("--llama-bench", type=Path, help="for --explore llamacpp")
    ap.add_argument("--preset", default=None, help="the model's shape (a preset, written as uniform Q4_0; default "
                    "the Qwen3-30B-A3B shape of benchmarks/llamacpp_gpu.py; e.g. Qwen3-235B-A22B:Q8_0 for 4 GPUs)")
    ap.add_argument("--hardware", type=Path, default=H100_PROFILE, help="profile of the sim search")
    ap.add_argument("--threads", type=int, help="host threads of the plans (-t; default the profile's: 16, the "
                    "H100 box's cores); 0: no -t, llama.cpp's default as --fit has it (the cost model then assumes "
                    "the profile's), for a serving machine whose cores differ from the profile's")
    ap.add_argument("--serve-threads", type=int, help="serve every contender, --fit too, at -t N (the thread count "
                    "measured best on the machine; default: each its own, --fit the server's default)")
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--name", default="workload_vs_fit")
    ap.add_argument("--series", default="")
    ap.add_argument("--report-only", type=Path, metavar="JSON", help="rewrite the report from <workdir>'s studies, "
                    "running nothing, with the meta of this earlier workload_vs_fit.json")
    ap.add_argument("--note", type=Path, help="with --report-only: a Markdown file of notes for the report")
    ap.add_argument("--time-budget", type=float, default=500.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per server run")
    ap.add_argument("--repetitions", type=int, default=1, help="timed requests per class in one server run "
                    "(default 1: the rounds give the spread)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log each server's progress")
    args = ap.parse_args(argv)
    import llamacpp_gpu
    args.preset = args.preset or llamacpp_gpu.PRESET
    from planner.errors import InputError
    from planner.presets import load_preset
    try:
        load_preset(args.preset)
    except InputError as e:
        raise SystemExit(f"workload_vs_fit: --preset: {e}") from None
    deadline = time.monotonic() + args.time_budget
    cells = parse_cells(args.cells)
    workdir = args.workdir or (DEFAULT_WORKDIR / "cpu" if args.cpu else DEFAULT_WORKDIR)
    workdir.mkdir(parents=True, exist_ok=True)
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else workdir / "report")
    args.storage = f"sqlite:///{workdir / 'workload_vs_fit.db'}"
    if args.report_only:
        meta = json.loads(args.report_only.read_text())["meta"]
        if args.note:
            meta["note"] = args.note.read_text()
        report(args, cells, meta, out)
        return 0
    os.chdir(ROOT)              # the model's path is relative to the repository: the same study on every machine
    model = model_path(args, workdir)
    inv = load_inventory(Path(os.path.relpath(model, ROOT)))
    hw0 = load_hardware(str(args.hardware))
    if args.serve_threads is not None and args.serve_threads < 1:
        raise SystemExit(f"workload_vs_fit: --serve-threads {args.serve_threads}: give 1 or more")
    if args.threads is not None and args.threads < 0:
        raise SystemExit(f"workload_vs_fit: --threads {args.threads}: give 0 (llama.cpp's default) or more")
    if args.threads:
        hw0 = replace(hw0, host=replace(hw0.host, n_threads=args.threads))
    bench_engine = None           # sim: tuner_for makes one per cell, on the cell's budget
    if args.explore == "llamacpp":
        from runtime.llamacpp import LlamaCppEngine
        bench_engine = LlamaCppEngine(binary=args.llama_bench, model_path=model, timeout_s=args.timeout,
                                      cpu_stand_in=args.cpu)
    meta = {"date": datetime.date.today().isoformat(), "model": model_rel(args.preset) if not args.cpu else "tiny",
            "explore": args.explore, "trials": args.trials, "rounds": args.rounds, "finalists": args.finalists,
            "gpu": None}
    explore(args, inv, hw0, cells, bench_engine)
    if args.prepare:
        report(args, cells, meta, out)
        return 0
    from runtime.llamaserver import LlamaServerEngine
    server = LlamaServerEngine(binary=args.server or _default_server(args), model_path=model,
                               timeout_s=args.timeout, repetitions=args.repetitions, cpu_stand_in=args.cpu,
                               progress=lambda what: log(f"  server: {what}") if args.verbose else None)
    from runtime.gpumem import gpu_summary
    meta["gpu"] = gpu_summary()
    finished = serve(args, inv, hw0, cells, deadline, server, bench_engine,
                     checkpoint=lambda: report(args, cells, meta, out))
    rows = report(args, cells, meta, out)
    return 0 if finished and all(r["served"] for r in rows) and len(rows) == len(cells) else 3


def _default_server(args) -> Path:
    if args.cpu:
        from runtime.server_process import server_binary
        return server_binary("mainline")
    return ROOT / "benchmarks" / "results" / "llamacpp_gpu" / "llama.cpp-cuda" / "build" / "bin" / "llama-server"


if __name__ == "__main__":
    sys.exit(main())
