"""`demo`: the main job on the embedded default: a sim-engine study, its report and the best flags."""
from __future__ import annotations

import argparse
from dataclasses import replace

from ..errors import InputError
from ..options import TuneOptions
from ..plan import DEFAULT_CTX
from .common import _cuda_available
from .tune import cmd_tune

# the demo's study: what studies/demo.toml spells out (a test holds the two equal), built in so that `demo` runs
# from any folder. Qwen3-30B-A3B Q4_K_M on a 16 GiB RTX 4090 with dual-channel DDR5, sim engine, objective both.
DEMO = TuneOptions(model="preset:Qwen3-30B-A3B:Q4_K_M", engine="sim", hardware="rtx4090-ddr5", gpu="16GiB",
                   trials=60, study="demo", objective="both", reps=1, ctx=DEFAULT_CTX, pool=120)


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job on the embedded default: a whole study on the sim engine, its report and the best flags."""
    from pathlib import Path
    from ..tuner.search import default_storage, sqlite_path
    from ..studyspec import load_spec, storage_beside
    base = TuneOptions(**load_spec(args.spec)) if args.spec else DEMO
    opts = replace(base, fresh=True, quiet=args.quiet, trials=args.trials if args.trials is not None else base.trials,
                   pool=args.pool if args.pool is not None else base.pool)
    print(f"# offload-tuner demo: tune {opts.model} on {opts.gpu or 'the'} GPU ({opts.hardware}) with the "
          f"{opts.engine} engine, {opts.trials} runs, objective {opts.objective}", flush=True)
    storage = opts.storage or (storage_beside(opts.spec, opts.study) if opts.spec else default_storage(opts.study))
    db = sqlite_path(storage)
    for folder in ({db.parent} if db else set()) | {Path("reports")}:
        if folder.exists() and not folder.is_dir():
            raise InputError(f"demo writes into {folder}/, but {folder} here is a file; run it in another folder")
    for suffix in ("", "-wal", "-shm", "-journal") if db else ():    # a fresh study each run: repeated demos agree
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    rc = cmd_tune(opts)
    if rc == 0 and _cuda_available():
        print()
        print("# a CUDA GPU is here: the same study measured on the bundled PyTorch runtime:")
        print(f"offload-tuner tune {opts.model} --engine torch --gpu {opts.gpu} --objective {opts.objective} "
              f"--trials 40 --study {opts.study}-torch --n-prompt {opts.n_prompt} --n-gen {opts.n_gen}")
    return rc


def add_parser(sub) -> None:
    """Registers `demo` and its options."""
    p = sub.add_parser("demo", help="the main job on the embedded default: a sim-engine study, its report, the best "
                                    "flags (no GPU or llama.cpp needed)")
    p.add_argument("--spec", metavar="FILE", help="the study to run as the demo (default: the built-in one, "
                                                  "which studies/demo.toml spells out)")
    p.add_argument("--trials", type=int, help=f"engine runs (default {DEMO.trials})")
    p.add_argument("--pool", type=int, help=f"candidates the cost model pre-screens (default {DEMO.pool})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_demo)
