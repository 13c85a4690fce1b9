"""TG against the host thread count (-t) with experts in RAM, on the mainline llama-bench (docs/llamacpp.md section
13): a few counts on one placement, all of the CPUs among them (llama.cpp's default where every vCPU shows as a
core). Its best count is what benchmarks/workload_vs_fit.py serves every contender at (`--serve-threads`).

    python3 benchmarks/threads_sweep.py --model M.gguf --name threads_h200x4 [--placement "-ngl 99 -ncmoe 47"]
      [--threads 8,16,32,64] [--n-gen 16] [--reps 3] [--out DIR]
    python3 benchmarks/threads_sweep.py --from RAW.json --machine MACHINE.txt --name NAME --out DIR   (report only)

Writes NAME.json (llama-bench's records, the machine's CPU lines and the best count) and NAME.md in --out
(default benchmarks/reported), and prints the best count alone on its last line (for a device call's shell).
Default --threads: 8, a quarter, half and all of the host's CPUs. Exit 2 on bad input, 1 when llama-bench failed.
Here, without a GPU: `--llama-bench` the CPU build and a tiny model (tests/runtime/test_threads_sweep.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BENCH = ROOT / "benchmarks/results/llamacpp_gpu/llama.cpp-cuda/build/bin/llama-bench"
CPU_LINES = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node(s)")


def default_threads(n_cpus: int) -> list[int]:
    return sorted({t for t in (8, n_cpus // 4, n_cpus // 2, n_cpus) if t >= 1})


def cpu_lines(text: str) -> dict[str, str]:
    """lscpu's lines that say how many threads a default -t takes."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in CPU_LINES:
            out[key.strip()] = value.strip()
    return out


def run_bench(bench: Path, model: Path, placement: list[str], threads: list[int], n_gen: int, reps: int
              ) -> list[dict[str, Any]]:
    cmd = [str(bench), "-m", str(model), *placement, "-p", "0", "-n", str(n_gen), "-r", str(reps),
           "-t", ",".join(map(str, threads)), "-o", "json"]
    print("$ " + shlex.join(cmd), file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"llama-bench exited {done.returncode}: {tail}")
    return json.loads(done.stdout)


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [{"threads": r["n_threads"], "tg": r["avg_ts"], "sd": r["stddev_ts"], "samples": r.get("samples_ts", [])}
            for r in records if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
    if not rows:
        raise ValueError("no TG record (llama-bench -p 0 -n N)")
    best = max(rows, key=lambda r: r["tg"])
    for r in rows:
        r["vs_best"] = r["tg"] / best["tg"]
    return {"rows": sorted(rows, key=lambda r: r["threads"]), "best": best["threads"]}


def markdown(name: str, s: dict[str, Any], machine: dict[str, str], command: str) -> str:
    worst = min(s["rows"], key=lambda r: r["tg"])
    best = next(r for r in s["rows"] if r["threads"] == s["best"])
    lines = [f"# {name}: TG against the host thread count, experts in RAM", "",
             f"Best: -t {s['best']}, {best['tg']:.2f} t/s; -t {worst['threads']} gave {worst['tg']:.2f} "
             f"({worst['vs_best']:.2f}x of it).", "",
             "Machine: " + (", ".join(f"{k} {v}" for k, v in machine.items()) or "not recorded"), "",
             f"Command: `{command}`", "",
             "| -t | TG t/s | stddev | samples | of the best |", "|---|---|---|---|---|"]
    for r in s["rows"]:
        lines.append(f"| {r['threads']} | {r['tg']:.2f} | {r['sd']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in r['samples'])} | {r['vs_best']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--llama-bench", type=Path, default=DEFAULT_BENCH)
    ap.add_argument("--placement", default="-ngl 99 -ncmoe 47", help="llama-bench flags of the placement "
                    "(default: every layer on the GPUs, the experts of the first 47 in RAM)")
    ap.add_argument("--threads", help="comma-separated counts (default 8, a quarter, half and all of the CPUs)")
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--from", dest="raw", type=Path, help="llama-bench's JSON records already measured: report only")
    ap.add_argument("--machine", type=Path, help="lscpu's output (default: run lscpu)")
    ap.add_argument("--command", default="", help="with --from: the command that measured them")
    ap.add_argument("--name", default="threads_sweep")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/reported")
    args = ap.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")] if args.threads else default_threads(os.cpu_count() or 1)
    except ValueError:
        print(f"threads_sweep: --threads {args.threads}: give counts like 8,16,32", file=sys.stderr)
        return 2
    if min(threads) < 1 or args.n_gen < 1 or args.reps < 1:
        print("threads_sweep: --threads, --n-gen and --reps are 1 or more", file=sys.stderr)
        return 2
    if args.raw is None and (args.model is None or not args.model.is_file()):
        print(f"threads_sweep: --model {args.model}: no such file (or give --from RAW.json)", file=sys.stderr)
        return 2
    if args.raw is None and not args.llama_bench.is_file():
        print(f"threads_sweep: no llama-bench at {args.llama_bench} (build it: benchmarks/llamacpp_gpu.sh build)",
              file=sys.stderr)
        return 2
    if args.machine is not None:
        machine = cpu_lines(args.machine.read_text(errors="replace"))
    else:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True) if shutil.which("lscpu") else None
        machine = cpu_lines(lscpu.stdout) if lscpu and lscpu.returncode == 0 else {}
    try:
        if args.raw is not None:
            records, command = json.loads(args.raw.read_text()), args.command
        else:
            placement = shlex.split(args.placement)
            records = run_bench(args.llama_bench, args.model, placement, threads, args.n_gen, args.reps)
            command = shlex.join(["llama-bench", "-m", args.model.name, *placement, "-p", "0", "-n",
                                  str(args.n_gen), "-r", str(args.reps), "-t", ",".join(map(str, threads))])
        s = summary(records)
    except (ValueError, KeyError, TypeError) as e:
        print(f"threads_sweep: unreadable records: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"threads_sweep: {e}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "machine": machine, **s, "records": records}, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(markdown(args.name, s, machine, command))
    print(s["best"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
