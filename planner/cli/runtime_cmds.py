"""`run`, `synth` and `calibrate`: the runtime's commands, reached by name through planner.engines'
registry (runtime/run_cli.py, runtime/synth.py, runtime/calibrate.py do the work and add their own options)."""
from __future__ import annotations

import argparse

from .. import engines


def cmd_run(args: argparse.Namespace) -> int:
    return engines.runtime("run")(args)


def cmd_synth(args: argparse.Namespace) -> int:
    return engines.runtime("synth")(args) or 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    return engines.runtime("calibrate")(args)


def add_parser(sub) -> None:
    """Registers `run`, `synth` and `calibrate`, their options named by the runtime."""
    p = sub.add_parser("run", help="measure one plan on an engine (llamacpp, sim, torch)")
    engines.runtime("add_run_arguments")(p)
    p.epilog = "the plan: --plan FILE, or -- and the llama.cpp arguments"
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("synth", help="write a synthetic GGUF that llama.cpp loads")
    engines.runtime("add_synth_arguments")(p)   # the CLI is where planner and runtime meet, by name
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("calibrate", help="measure this machine's bandwidths, FLOP/s, PCIe and overheads (--hardware)")
    engines.runtime("add_calibrate_arguments")(p)
    p.set_defaults(func=cmd_calibrate)
