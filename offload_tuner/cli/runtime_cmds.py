"""`run`, `synth` and `calibrate`: the runtime's commands. Their flags are parsed here into typed arguments (a
planner.options.RunRequest; keyword arguments for synth and calibrate) and the work is done by plain functions in
runtime/ (run.py, synth.py, calibrate.py), reached by name through planner.engine_registry' registry; the results are
printed here.

    offload-tuner run MODEL --engine llamacpp|sim|torch [--llama-bench PATH] (--plan FILE | -- <llama.cpp args>)
                      [--n-prompt N --n-gen N --depth N --reps N] [--gpu SIZE | --hardware P] [--json]

`run` exits 0 when the measurement succeeded, 1 when it failed (the reason on stderr and in measurement.error),
2 for bad input."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from planner import defaults as D, engine_registry
from planner.hardware import fmt_bytes
from planner.options import RunRequest
from planner.plan import DIALECTS, device_sort_key
from . import logs
from .common import emit_json

if TYPE_CHECKING:
    from planner.engine_contract import Measurement
    from planner.memory import MemoryReport

log = logging.getLogger(__name__)
RUN_WORKLOAD = D.RUN_WORKLOAD


# ---- run ------------------------------------------------------------------------------------------------------------

def run_request(args: argparse.Namespace) -> RunRequest:
    return RunRequest(model=args.model, engine=args.engine, plan=args.plan, llama_args=tuple(args.llama_args),
                      llama_bench=args.llama_bench, dialect=args.dialect, n_prompt=args.n_prompt, n_gen=args.n_gen,
                      depth=args.depth, reps=args.reps, timeout_s=args.timeout, gpu=args.gpu, hardware=args.hardware)


def cmd_run(args: argparse.Namespace) -> int:
    from runtime.run import prepare_run
    run = prepare_run(run_request(args))     # checked, engine made
    w = run.bench
    if not args.json:
        log.info("# %s: measuring plan %s (%d prompt + %d generated tokens at depth %d, %d reps)", args.engine,
                 run.plan.id, w.n_prompt, w.n_gen, w.depth, w.repetitions)
    m = run.measure()
    if args.json:
        emit_json(run.to_json(m))
    else:
        print_measurement(m, run.memory, run.command)
    if not m.ok:
        print(f"offload-tuner: run failed: {m.error}", file=sys.stderr)
        return 1
    return 0


def print_measurement(m: Measurement, mem: MemoryReport, command: str | None) -> None:
    from planner.tables import table
    if command:
        print(f"command: {command}")
    status = "ok" if m.ok else f"FAILED ({m.raw.get('failure', 'error')}): {m.error}"
    print(f"result:  {status}")
    from runtime.run import rep_spread
    spread = rep_spread(m)

    def over(kind: str) -> str:            # the repetitions' spread, where the engine reports each one
        return f" ({spread[kind][0]:.2f}-{spread[kind][1]:.2f} over {spread[kind][2]} reps)" if kind in spread else ""
    print(f"PP {m.pp_tps:.2f} t/s{over('pp')}, TG {m.tg_tps:.2f} t/s{over('tg')}; "
          f"host peak RSS {fmt_bytes(m.host_bytes)}")
    rows = []
    for dev in sorted(set(mem.devices) | set(m.peak_bytes), key=device_sort_key):
        if dev == "CPU":
            continue
        pred = mem.devices[dev].total if dev in mem.devices else 0
        got = m.peak_bytes.get(dev)
        rows.append([dev, fmt_bytes(pred), fmt_bytes(got) if got is not None else "-",
                     fmt_bytes(got - pred) if got is not None else "-"])
    if rows:
        src = m.raw.get("vram_source", "")
        print(table(["device", "predicted", f"measured ({src})" if src else "measured", "measured - predicted"], rows))


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="path to a .gguf (the llamacpp engine needs the file) or preset:NAME[:QUANT]")
    p.add_argument("--engine", choices=engine_registry.names(), required=True)
    p.add_argument("--llama-bench", metavar="PATH", help="llama-bench or llama-sweep-bench (else $LLAMA_BENCH, "
                                                          "else llama-bench on PATH)")
    p.add_argument("--plan", metavar="FILE", help="Plan JSON (`plan --json` output or Plan.to_json())")
    p.add_argument("--dialect", choices=DIALECTS, help="for a command line after --: default the binary's "
                                                        "(llamacpp) or mainline")
    p.add_argument("--n-prompt", type=int, help=f"prompt tokens (default {RUN_WORKLOAD.n_prompt}, or -p)")
    p.add_argument("--n-gen", type=int, help=f"generated tokens (default {RUN_WORKLOAD.n_gen}, or -n)")
    p.add_argument("--depth", type=int, help="context depth before both (default 0, or -d)")
    p.add_argument("--reps", type=int, help=f"repetitions (default {RUN_WORKLOAD.repetitions}, or -r)")
    p.add_argument("--timeout", type=float, default=D.RUN_TIMEOUT_S,
                   help=f"seconds per run (llamacpp; default {D.RUN_TIMEOUT_S:.0f})")
    p.add_argument("--gpu", help="GPU sizes for sim and for the predicted memory, e.g. 24GiB")
    p.add_argument("--hardware", help="hardware preset or calibrated JSON (sim; predicted memory)")
    p.add_argument("--json", action="store_true")


# ---- synth ----------------------------------------------------------------------------------------------------------

def cmd_synth(args: argparse.Namespace) -> int:
    """Write the model the flags describe; print the paths written (stdout)."""
    from runtime.synth import synth
    paths = synth(
        args.out, preset=args.preset, arch=args.arch, tiny=args.tiny, quant=args.quant, sparse=args.sparse,
        split_max=args.split_max, seed=args.seed, tied_output=args.tied_output,
        progress_bar=not args.quiet and logs.shown())
    for p in paths:
        print(p)
    return 0


def _add_synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", metavar="NAME[:QUANT]", help="a well-known model, full size")
    from runtime.synth import tiny_archs
    p.add_argument("--arch", help=f"with --tiny: one of {', '.join(tiny_archs())}")
    p.add_argument("--tiny", action="store_true", help="a few-MB model of --arch (for tests)")
    p.add_argument("--quant", help="with --tiny: ggml type of the matrices (default Q8_0)")
    p.add_argument("--out", required=True, help="output .gguf (shards get -0000i-of-0000K)")
    p.add_argument("--sparse", action="store_true", help="headers only, files truncated to full size")
    p.add_argument("--split-max", metavar="SIZE", help="split into shards of at most SIZE (e.g. 50GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tied-output", action="store_true", help="no output.weight (token_embd is reused)")
    p.add_argument("--quiet", action="store_true")


# ---- calibrate ------------------------------------------------------------------------------------------------------

def cmd_calibrate(args: argparse.Namespace) -> int:
    from runtime.calibrate import calibrate_profile, summary
    d = calibrate_profile(out=args.out, dtype=args.dtype, threads=args.threads, size=args.size, name=args.name,
                          sweeps=args.sweeps)
    if args.json:
        emit_json(d)
    else:
        print(summary(d))
    return 0


def _add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="write the HardwareProfile JSON here (plan/tune accept it with --hardware)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="compute dtype (default bf16)")
    p.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    p.add_argument("--size", default="1GiB", help="bytes per bandwidth test (default 1GiB)")
    p.add_argument("--name", default="calibrated", help="profile name")
    p.add_argument("--sweeps", type=int, default=2, help="whole measurements to merge: the best of each ceiling, "
                   "the median of each per-op time (default 2; their spread is reported)")
    p.add_argument("--json", action="store_true", help="print the profile JSON on stdout")


def add_parser(sub) -> None:
    """Registers `run`, `synth` and `calibrate`."""
    p = sub.add_parser("run", help="measure one plan on an engine (llamacpp, sim, torch)")
    _add_run_arguments(p)
    p.epilog = "the plan: --plan FILE, or -- and the llama.cpp arguments"
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("synth", help="write a synthetic GGUF that llama.cpp loads")
    _add_synth_arguments(p)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("calibrate", help="measure this machine's bandwidths, FLOP/s, PCIe and overheads (--hardware)")
    _add_calibrate_arguments(p)
    p.set_defaults(func=cmd_calibrate)
