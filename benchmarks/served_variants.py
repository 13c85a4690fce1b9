"""Why a served finalist generates slower than llama-server's --fit: one knob at a time, on the server, interleaved.

The workload_vs_fit benchmark's 6 GiB finalists answered rag and agent requests with 5-10% less TG than --fit at
-ub 2048, and their filled twins (more experts on the GPU) were no faster. A finalist differs from --fit in more
than its placement: q8_0 KV (--fit keeps f16), `-t` set to the profile's 16 threads (--fit: llama.cpp's default),
its ubatch. This serves a cell's finalist as it was served and with one knob changed, beside the --fit reference,
in interleaved rounds, and reports each one's mean request time, TTFT, PP, TG and VRAM.

    GPU: python3 benchmarks/served_variants.py --cell 6:rag --key trial:18 --rounds 2   (after workload_vs_fit ran
         the cell on the same machine: its study database and the model are in its workdir)

Writes served_variants.{json,md} to --out (default $OUT, else <workdir>/report).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import workload_vs_fit as wvf  # noqa: E402
from planner.gguf_header import load_inventory  # noqa: E402
from tuner.confirm import Spread  # noqa: E402
from tuner.records import StudyRecord  # noqa: E402
from planner.workload import preset  # noqa: E402


def physical_cores() -> int:
    """Cores, not hardware threads (llama.cpp's default -t counts these on Linux)."""
    seen = set()
    for cpu in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        with contextlib.suppress(OSError):
            seen.add(((cpu / "physical_package_id").read_text().strip(), (cpu / "core_id").read_text().strip()))
    return len(seen) or os.cpu_count() or 1


def replaced(argv: list[str], flag: str, *values: str) -> list[str]:
    """argv with `flag`'s value(s) replaced (added when missing; values () removes the flag and its value)."""
    out, it = [], iter(argv)
    for a in it:
        if a == flag:
            next(it, None)
            continue
        out.append(a)
    return out + ([flag, *values] if values else [])


def variants(finalist: list[str], cores: int) -> dict[str, list[str]]:
    """The finalist, then one knob at a time toward what --fit runs."""
    kv16 = replaced(replaced(finalist, "-ctk", "f16"), "-ctv", "f16")
    out = {"as served": finalist, "no -t (llama.cpp's default)": replaced(finalist, "-t"), "f16 KV": kv16}
    if replaced(finalist, "-t", str(cores)) != replaced(finalist, "-t", finalist[finalist.index("-t") + 1]
                                                         if "-t" in finalist else ""):
        out[f"-t {cores} (physical cores)"] = replaced(finalist, "-t", str(cores))
        out[f"f16 KV, -t {cores}"] = replaced(kv16, "-t", str(cores))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", default="6:rag", help="BUDGET_GIB:WORKLOAD of the workload_vs_fit cell")
    ap.add_argument("--key", default="trial:18", help="the served contender to vary")
    ap.add_argument("--reference", default="fit:2048", help="the served reference beside it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=wvf.DEFAULT_WORKDIR)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--time-budget", type=float, default=500.0)
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.time_budget
    cell, = wvf.parse_cells(args.cell)
    wname = cell.workload
    import optuna
    study = optuna.load_study(study_name=cell.name(""),
                              storage=f"sqlite:///{args.workdir / 'workload_vs_fit.db'}")
    commands = {r["key"]: r.get("command") for r in (StudyRecord.of(study).served or {}).get("results", [])}
    if not commands.get(args.key) or not commands.get(args.reference):
        raise SystemExit(f"served_variants: {args.cell} has no served command for {args.key} and {args.reference}")
    split = {k: shlex.split(c) for k, c in commands.items() if c}
    cs = {f"{args.reference} (reference)": split[args.reference][1:],
          **variants(split[args.key][1:], physical_cores())}
    os.chdir(wvf.ROOT)
    model = wvf.ROOT / os.path.relpath(args.workdir, wvf.ROOT) / wvf.MODEL_REL
    inv = load_inventory(Path(os.path.relpath(model, wvf.ROOT)))
    from runtime.llamaserver import LlamaServerEngine
    server = LlamaServerEngine(binary=split[args.key][0], model_path=model, repetitions=1, timeout_s=300)
    w = preset(wname)
    rows: list[dict[str, Any]] = []
    names = list(cs)
    for rnd in range(args.rounds):
        for i in range(len(names)):
            name = names[(rnd + i) % len(names)]
            if rows and time.monotonic() + max(r["wall_s"] for r in rows) >= deadline:
                break
            m = server.serve_args(inv, cs[name], w)
            raw = m.raw or {}
            rows.append({"round": rnd, "name": name, "ok": m.ok, "error": m.error,
                         "request_s": raw.get("mean_request_s"), "ttft_s": raw.get("ttft_s"), "pp": m.pp_tps,
                         "tg": m.tg_tps, "vram": dict(m.peak_bytes), "wall_s": raw.get("wall_s") or 60.0})
            wvf.log(f"{name}: {rows[-1]['request_s']} s, TG {m.tg_tps:.1f}, PP {m.pp_tps:.0f} {m.error[:80]}")
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else args.workdir / "report")
    out.mkdir(parents=True, exist_ok=True)
    (out / "served_variants.json").write_text(json.dumps({"cell": args.cell, "key": args.key, "commands": cs,
                                                          "cores": physical_cores(), "rows": rows}, indent=2))
    L = [f"# {args.cell} {args.key}: one knob at a time on llama-server, {args.rounds} interleaved rounds", "",
         "| variant | mean request s | TTFT s | PP t/s | TG t/s | VRAM MiB |", "|---|---|---|---|---|---|"]
    def sp(good: list[dict[str, Any]], k: str, fmt: str) -> str:
        s = Spread(tuple(float(r[k]) for r in good))
        return f"{s.median:{fmt}} [{s.lo:{fmt}}-{s.hi:{fmt}}]" if s.samples else "-"
    for name in names:
        good = [r for r in rows if r["name"] == name and r["ok"] and r["request_s"]]
        vram = max((sum(r["vram"].values()) for r in good), default=0) >> 20
        L.append(f"| {name} | {sp(good, 'request_s', '.2f')} | {sp(good, 'ttft_s', '.2f')} | "
                 f"{sp(good, 'pp', '.0f')} | {sp(good, 'tg', '.1f')} | {vram} |")
    (out / "served_variants.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))
    return 0


if __name__ == "__main__":
    sys.exit(main())
