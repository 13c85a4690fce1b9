"""Acceptance figures for issues 12 and 17 on corpora the tests never saw (other seeds):

1. fuzz: N mutated GGUF files of every kind (tests/planner/gguf_fuzz.py) through `inspect --json`,
   `explain --json -- -ngl 99 -ot exps=CPU` and `plan --gpu 1GiB --json`: counts of success, clean one-line
   errors (exit 2), tracebacks, hangs, other exits, multi-line errors.
2. agreement: M structurally mutated files, our verdict (`explain --dialect mainline -- -ngl 0`) against the CPU
   llama-bench's (`-ngl 0`); the files where they differ.
3. workers: R rounds of two `tune` workers started together on one SQLite study: how each ended.

    PYTHONPATH=. python benchmarks/fuzz_acceptance.py --seed 777 --fuzz 3000 --agree 500 --rounds 10
Writes benchmarks/reported/fuzz_acceptance.json and prints a summary.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "planner"))     # gguf_fuzz, loader_verdict
sys.path.insert(0, str(ROOT / "tests"))                 # cli_outcome (shared with tests/cli)
sys.path.insert(0, str(ROOT))

import gguf_fuzz as gf            # noqa: E402
import loader_verdict as lv       # noqa: E402
from cli_outcome import run_cli   # noqa: E402


def fuzz(root: Path, n: int, seed: int) -> dict:
    files = gf.corpus(gf.make_seeds(root / "seeds"), root / "fuzz", n, seed)
    counts: collections.Counter[str] = collections.Counter()
    per_cmd: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    bad = []
    t0 = time.time()
    for path, label in files:
        for argv in gf.commands(path):
            o = run_cli(argv, time_limit_s=30)
            counts[o.kind] += 1
            per_cmd[argv[0]][o.kind] += 1
            if not o.clean:
                bad.append({"file": label, "command": argv[0], "kind": o.kind, "stderr": o.stderr[-1000:]})
    return {"files": n, "seed": seed, "runs": sum(counts.values()), "outcomes": dict(counts),
            "per_command": {k: dict(v) for k, v in per_cmd.items()}, "not_clean": bad[:50],
            "seconds": round(time.time() - t0, 1)}


def agreement(root: Path, n: int, seed: int, binary: Path) -> dict:
    seeds = gf.make_seeds(root / "seeds")
    files = gf.corpus(seeds, root / "agree", n, seed, kinds=tuple(gf.STRUCTURAL),
                      archs=tuple(a for a in seeds if a != "split"))
    table: collections.Counter[str] = collections.Counter()
    differ = []
    t0 = time.time()
    for path, label in files:
        a, why_a = lv.ours(path)
        b, why_b = lv.llama_bench(binary, path)
        table[f"ours {'accept' if a else 'refuse'} / llama-bench {'accept' if b else 'refuse'}"] += 1
        if a != b:
            differ.append({"file": label, "ours": why_a[:300], "llama_bench": why_b[:300]})
    return {"files": n, "seed": seed, "agree": n - len(differ), "table": dict(table), "differ": differ,
            "seconds": round(time.time() - t0, 1)}


def workers(root: Path, rounds: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ends: collections.Counter[str] = collections.Counter()
    detail = []
    for r in range(rounds):
        db = root / f"w{r}.db"
        cmd = [sys.executable, "-m", "offload_tuner.cli", "tune", "preset:Qwen3-30B-A3B", "--engine", "sim", "--gpu",
               "16GiB", "--trials", "6", "--study", "shared", "--storage", f"sqlite:///{db}", "--pool", "0",
               "--quiet", "--no-report"]
        procs = [subprocess.Popen(cmd + ["--seed", str(s)], cwd=root, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for s in (1, 2)]
        for p in procs:
            _, err = p.communicate(timeout=900)
            if "Traceback" in err:
                end = "traceback"
            elif p.returncode == 0:
                end = "finished"
            elif p.returncode == 2 and "postgresql://" in err and len(err.strip().splitlines()) == 1:
                end = "refused at start (one line, points at PostgreSQL)"
            else:
                end = f"exit {p.returncode}"
            ends[end] += 1
            detail.append({"round": r, "end": end, "stderr": err.strip()[-300:]})
    return {"rounds": rounds, "workers": dict(ends), "detail": detail}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=777)
    ap.add_argument("--fuzz", type=int, default=3000)
    ap.add_argument("--agree", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "reported" / "fuzz_acceptance.json"))
    args = ap.parse_args()
    from runtime.llamacpp_build import ensure_built
    binary = ensure_built()["llama-bench"]
    report = {"command": " ".join(sys.argv)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.fuzz:
            report["fuzz"] = fuzz(root, args.fuzz, args.seed)
            print("fuzz:", json.dumps({k: v for k, v in report["fuzz"].items() if k != "not_clean"}), flush=True)
        if args.agree:
            report["agreement"] = agreement(root, args.agree, args.seed + 1, binary)
            a = report["agreement"]
            print(f"agreement: {a['agree']}/{a['files']} {a['table']} ({a['seconds']} s)", flush=True)
        if args.rounds:
            report["workers"] = workers(root, args.rounds)
            print("workers:", report["workers"]["workers"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
