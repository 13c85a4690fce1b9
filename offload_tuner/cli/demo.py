"""`demo`: the main job on the embedded default: a sim-engine study, its report and the best flags."""
from __future__ import annotations

import argparse

from ..app.common import cuda_available
from ..app.demo import clear_demo_study, demo_options
from ..app.requests import DemoRequest
from .common import add_option, request
from .tune import cmd_tune


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the embedded default: a whole study on the sim engine, its report and the best flags."""
    opts = demo_options(request(DemoRequest, args))
    print(f"# offload-tuner demo: tune {opts.model} on {opts.gpu or 'the'} GPU ({opts.hardware}) with the "
          f"{opts.engine} engine, {opts.trials} runs, objective {opts.objective}", flush=True)
    clear_demo_study(opts)
    rc = cmd_tune(opts)
    if rc == 0 and cuda_available():
        print()
        print("# a CUDA GPU is here: the same study measured on the bundled PyTorch runtime:")
        print(f"offload-tuner tune {opts.model} --engine torch --gpu {opts.gpu} --objective {opts.objective} "
              f"--trials 40 --study {opts.study}-torch"
              + "".join(f" --{k.replace('_', '-')} {v}" for k in ("n_prompt", "n_gen") if (v := getattr(opts, k))
                        is not None))
    return rc


def add_parser(sub) -> None:
    """Registers `demo` and its options."""
    p = sub.add_parser("demo", help="the main job on the embedded default: a sim-engine study, its report, the best "
                                    "flags (no GPU or llama.cpp needed)")
    add_option(p, DemoRequest, "spec", metavar="FILE")
    add_option(p, DemoRequest, "trials")
    add_option(p, DemoRequest, "pool")
    add_option(p, DemoRequest, "quiet")
    p.set_defaults(func=cmd_demo)
