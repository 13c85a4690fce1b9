"""Split modes beyond `-sm layer`, measured (issue 30 item 3): each engine's llama-bench at each split mode it offers
(mainline: layer, tensor; ik_llama.cpp: layer, graph), on the same placements (every tensor on the GPUs, the experts
of the first N layers in RAM), flash attention on for all (mainline's tensor mode forces it). Each run is its own
process with its VRAM peak sampled per GPU (runtime.gpumem); the modes run in interleaved rounds, their order
reversed every other round, so a slow spell of the machine falls on both sides. A mode that does not load (a split
buffer the backend lacks, a mode refused for the model) is a row with its error line, not the end of the run.

    python3 benchmarks/split_modes.py --model M.gguf --modes mainline:layer,mainline:tensor,ik:layer,ik:graph \
      --placement "all-gpu=-ngl 99" --placement "experts-in-ram=-ngl 99 --n-cpu-moe 40" -t 16 \
      --name split_modes_h100x2 --out DIR --time-budget 500

Binaries: --bench ENGINE=PATH (defaults: the CUDA builds of benchmarks/llamacpp_gpu.sh, `build` and `build-ik`).
Resumable across device calls: each run is a line of <workdir>/NAME_runs.jsonl (default workdir
benchmarks/results/split_modes), skipped when found again; no run starts with less than --min-left seconds of
--time-budget left. Writes NAME.json and NAME.md to --out (default $OUT, else <workdir>); `--report-only A.json
B.json --name NAME --note NOTE.md` rewrites them from earlier reports, their runs merged (one engine's call beside
another's). Exit 3 while runs are left, 0 when all ran, 2 on bad input. Here, without a GPU: the CPU build and a
tiny model (tests/runtime/test_split_modes.py: tensor mode needs a GPU device there, so it is a failed row).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import gpumem  # noqa: E402
from runtime.llamacpp_output import classify_failure, parse_bench_output  # noqa: E402
from runtime.process import run_process  # noqa: E402

BUILDS = ROOT / "benchmarks" / "results" / "llamacpp_gpu"
DEFAULT_BENCH = {"mainline": BUILDS / "llama.cpp-cuda" / "build" / "bin" / "llama-bench",
                 "ik": BUILDS / "ik_llama.cpp-cuda" / "build" / "bin" / "llama-bench"}
# what each pinned llama-bench takes after -sm (its usage line); `row` loads on neither build's CUDA backend here
MODES = {"mainline": ("none", "layer", "row", "tensor"), "ik": ("none", "layer", "graph")}
MiB = 1 << 20


class BadInput(Exception):
    pass


@dataclass(frozen=True)
class Run:
    round: int
    placement: str
    engine: str
    mode: str

    @property
    def key(self) -> str:
        return f"{self.round}/{self.placement}/{self.engine}/{self.mode}"


def parse_modes(text: str) -> list[tuple[str, str]]:
    out = []
    for part in text.split(","):
        engine, _, mode = part.strip().partition(":")
        if mode not in MODES.get(engine, ()):
            raise BadInput(f"--modes {text!r}: give ENGINE:MODE pairs, "
                           + "; ".join(f"{e}: {', '.join(m)}" for e, m in MODES.items()))
        out.append((engine, mode))
    return out


def parse_placement(text: str) -> tuple[str, list[str]]:
    name, sep, flags = text.partition("=")
    if not sep or not name.strip() or not flags.strip() or "/" in name:
        raise BadInput(f"--placement {text!r}: give NAME=LLAMA-BENCH FLAGS, e.g. \"experts-in-ram=-ngl 99 "
                       "--n-cpu-moe 40\"")
    flags_list = shlex.split(flags)
    if any(f in ("-sm", "--split-mode", "-t", "--threads", "-o", "-m", "-r", "-p", "-n") for f in flags_list):
        raise BadInput(f"--placement {text!r}: the mode, threads, model and test sizes are the benchmark's own flags")
    return name.strip(), flags_list


def schedule(placements: list[str], modes: list[tuple[str, str]], rounds: int) -> list[Run]:
    """Per round and placement every mode once; odd rounds run the modes in reverse (ABBA)."""
    out = []
    for r in range(rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        out += [Run(r, p, e, m) for p in placements for e, m in order]
    return out


def command(bench: Path, model: Path, flags: list[str], run: Run, args) -> list[str]:
    return [str(bench), "-m", str(model), *flags, "-sm", run.mode, "-fa", "1", "-t", str(args.threads),
            "-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.reps), "-o", "json", "-v"]


def measure(cmd: list[str], timeout_s: float, sampler) -> dict[str, Any]:
    """One llama-bench run (runtime.process: its process group ended past the time limit, VRAM sampled per GPU):
    its PP and TG, or why it failed (runtime.llamacpp_output.classify_failure; runs are -v, so a load failure
    names its cause)."""
    run = run_process(cmd, dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID"), timeout_s, sampler)
    results = parse_bench_output(run.stdout)
    pp = next((r for r in results if r.kind == "pp"), None)
    tg = next((r for r in results if r.kind == "tg"), None)
    rec: dict[str, Any] = {"ok": False, "seconds": round(run.wall_s, 1),
                           "vram_mib": {d: b / MiB for d, b in run.gpu_peak_bytes.items()}}
    failed = classify_failure(run.stdout, run.stderr, run.returncode, timed_out=run.timed_out, timeout_s=timeout_s,
                              have_results=pp is not None and tg is not None)
    if failed is not None or pp is None or tg is None:
        return rec | {"error": failed.message if failed else "llama-bench gave no PP or no TG record"}
    return rec | {"ok": True, "pp": pp.avg_ts, "pp_sd": pp.stddev_ts, "tg": tg.avg_ts, "tg_sd": tg.stddev_ts}


def load_runs(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    runs = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            runs[r["key"]] = r
    return runs


def _spread(xs: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(xs), "lo": min(xs), "hi": max(xs)} if xs else None


def summarise(runs: list[dict[str, Any]], placements: list[str], modes: list[tuple[str, str]]) -> list[dict[str, Any]]:
    rows = []
    for p in placements:
        for e, m in modes:
            rs = [r for r in runs if r["placement"] == p and r["engine"] == e and r["mode"] == m]
            ok = [r for r in rs if r["ok"]]
            gpus = sorted({d for r in ok for d in r["vram_mib"]})
            rows.append({"placement": p, "engine": e, "mode": m, "runs": len(rs), "ok": len(ok),
                         "pp": _spread([r["pp"] for r in ok]), "tg": _spread([r["tg"] for r in ok]),
                         "vram_mib": {d: max(r["vram_mib"].get(d, 0) for r in ok) for d in gpus},
                         "errors": sorted({r["error"] for r in rs if not r["ok"]})})
    for row in rows:      # against -sm layer of the same engine and placement
        layer = next((x for x in rows if x["placement"] == row["placement"] and x["engine"] == row["engine"]
                      and x["mode"] == "layer"), None)
        for k in ("pp", "tg"):
            row[f"{k}_vs_layer"] = (row[k]["median"] / layer[k]["median"]
                                    if row[k] and layer and layer[k] and row is not layer else None)
    return rows


def verdict(rows: list[dict[str, Any]], k: str) -> str | None:
    """Which mode of one engine won `k` ("pp" or "tg") on one placement: the best median, "ahead" when its lowest
    round is above every other mode's highest, else a tie inside the spreads. Engines are not set against each
    other: their rounds were not interleaved with each other's."""
    ran = sorted((r for r in rows if r[k]), key=lambda r: -r[k]["median"])
    if len(ran) < 2:
        return None
    best, rest = ran[0], ran[1:]
    apart = all(best[k]["lo"] > r[k]["hi"] for r in rest)
    others = ", ".join(f"{best[k]['median'] / r[k]['median']:.2f}x {r['mode']}" for r in rest)
    return (f"{k.upper()}: -sm {best['mode']} {'ahead' if apart else 'first, a tie inside the spreads'} "
            f"({best[k]['median']:.1f} t/s, {others})")


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    def s(x: dict[str, float] | None) -> str:
        return f"{x['median']:.1f} [{x['lo']:.1f}-{x['hi']:.1f}]" if x else "-"

    def v(x: float | None) -> str:
        return f"{x:.2f}x" if x else "-"
    L = [f"# Split modes: {meta['name']}", "",
         f"{meta['date']}; {meta.get('gpu') or 'no GPU'}; model {meta['model']}; llama-bench -p {meta['n_prompt']} "
         f"-n {meta['n_gen']} -r {meta['reps']} -fa 1 -t {meta['threads']}, {meta['rounds']} interleaved rounds "
         "(order reversed every other round). PP and TG are the median [min-max] over the rounds of llama-bench's "
         "mean; VRAM the largest peak per GPU over the rounds (the run's process, baseline subtracted).", ""]
    for p in meta["placements"]:
        L += [f"## {p}: `{meta['placements'][p]}`", "",
              "| engine | -sm | PP t/s | TG t/s | PP / TG against layer | VRAM MiB per GPU | runs ok | failed |",
              "|---|---|---|---|---|---|---|---|"]
        for r in (x for x in rows if x["placement"] == p):
            vram = " + ".join(f"{b:.0f}" for _, b in sorted(r["vram_mib"].items())) or "-"
            L.append(f"| {r['engine']} | {r['mode']} | {s(r['pp'])} | {s(r['tg'])} | {v(r['pp_vs_layer'])} / "
                     f"{v(r['tg_vs_layer'])} | {vram} | {r['ok']} of {r['runs']} | {'; '.join(r['errors']) or '-'} |")
        L.append("")
        for e in dict.fromkeys(r["engine"] for r in rows if r["placement"] == p):
            said = [x for k in ("pp", "tg") if (x := verdict([r for r in rows if r["placement"] == p
                                                                and r["engine"] == e], k))]
            L.append(f"- {e}: " + ("; ".join(said) if said else "fewer than two modes ran: nothing to set apart"))
        L.append("")
    if meta.get("note"):
        L += [meta["note"], ""]
    return "\n".join(L)


def write(out: Path, meta: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    modes = [tuple(m.split(":")) for m in meta["modes"]]
    rows = summarise(runs, list(meta["placements"]), modes)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{meta['name']}.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1) + "\n")
    (out / f"{meta['name']}.md").write_text(markdown(meta, rows))


def report_only(args) -> int:
    try:
        olds = [json.loads(p.read_text()) for p in args.report_only]
        meta = dict(olds[0]["meta"], name=args.name, note=args.note.read_text() if args.note else None)
        meta["modes"] = list(dict.fromkeys(m for o in olds for m in o["meta"]["modes"]))
        meta["placements"] = {p: f for o in olds for p, f in o["meta"]["placements"].items()}
        meta["rounds"] = max(o["meta"]["rounds"] for o in olds)
        runs = list({r["key"]: r for o in olds for r in o["runs"]}.values())
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"split_modes: --report-only: not a split_modes report: {e}", file=sys.stderr)
        return 2
    write(args.out or args.workdir, meta, runs)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--modes", default="mainline:layer,mainline:tensor")
    ap.add_argument("--placement", action="append", help="NAME=FLAGS, repeatable (default all-gpu=-ngl 99)")
    ap.add_argument("--bench", action="append", default=[], help="ENGINE=PATH of its llama-bench")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-p", "--n-prompt", type=int, default=2048)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("-r", "--reps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "results" / "split_modes")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--name", default="split_modes")
    ap.add_argument("--note", type=Path, help="a Markdown file of notes for the report")
    ap.add_argument("--report-only", type=Path, nargs="+", metavar="JSON", help="rewrite the report from earlier "
                    "NAME.json files (their runs merged, the first one's settings), running nothing")
    ap.add_argument("--time-budget", type=float, default=500.0)
    ap.add_argument("--min-left", type=float, default=60.0, help="start no run with less time left (s)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per llama-bench run")
    args = ap.parse_args(argv)
    if args.report_only:
        return report_only(args)
    deadline = time.monotonic() + args.time_budget
    try:
        modes = parse_modes(args.modes)
        placements = dict(parse_placement(p) for p in (args.placement or ["all-gpu=-ngl 99"]))
        benches = dict(DEFAULT_BENCH)
        for b in args.bench:
            engine, sep, path = b.partition("=")
            if not sep or engine not in MODES:
                raise BadInput(f"--bench {b!r}: give ENGINE=PATH, ENGINE one of {', '.join(MODES)}")
            benches[engine] = Path(path)
        for engine in {e for e, _ in modes}:
            if not benches[engine].is_file():
                raise BadInput(f"no {engine} llama-bench at {benches[engine]} (build it: benchmarks/llamacpp_gpu.sh "
                               f"{'build-ik' if engine == 'ik' else 'build'}, or give --bench {engine}=PATH)")
        if args.model is None or not args.model.is_file():
            raise BadInput(f"--model {args.model}: no such file")
        if min(args.threads, args.n_prompt, args.n_gen, args.reps, args.rounds) < 1:
            raise BadInput("-t, -p, -n, -r and --rounds are 1 or more")
    except BadInput as e:
        print(f"split_modes: {e}", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    runs_path = args.workdir / f"{args.name}_runs.jsonl"
    done = load_runs(runs_path)
    sampler = gpumem.detect()
    left = False
    for run in schedule(list(placements), modes, args.rounds):
        if run.key in done:
            continue
        if deadline - time.monotonic() < args.min_left:
            left = True
            break
        cmd = command(benches[run.engine], args.model, placements[run.placement], run, args)
        print(f"[{time.strftime('%H:%M:%S')}] {run.key}: $ {shlex.join(cmd)}", file=sys.stderr, flush=True)
        rec = {"key": run.key, **asdict(run), **measure(cmd, args.timeout, sampler)}
        rec["command"] = shlex.join(["llama-bench", *cmd[1:]])
        got = f"PP {rec['pp']:.1f} TG {rec['tg']:.1f}" if rec["ok"] else rec["error"]
        print(f"  -> {got}; "
              f"VRAM {rec['vram_mib']}", file=sys.stderr, flush=True)
        with runs_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        done[run.key] = rec
    meta = {"name": args.name, "date": datetime.date.today().isoformat(), "gpu": gpumem.gpu_summary(),
            "model": args.model.name, "threads": args.threads, "n_prompt": args.n_prompt, "n_gen": args.n_gen,
            "reps": args.reps, "rounds": args.rounds, "modes": [f"{e}:{m}" for e, m in modes],
            "placements": {p: shlex.join(f) for p, f in placements.items()},
            "note": args.note.read_text() if args.note else None}
    write(args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else args.workdir), meta, list(done.values()))
    return 3 if left else 0


if __name__ == "__main__":
    sys.exit(main())
