"""The options the resumable device benchmarks share (llamacpp_gpu, tune_vs_fit, ik_gpu, multi_gpu): one name,
type and help for each, the defaults per benchmark.

A benchmark's defaults are a table {option: (GPU value, --cpu dry-run value)}; its workload and study options
default to None on the command line, and `resolve` fills them from the table once --cpu is known, so the help
text and the value come from the same entry.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

Defaults = dict[str, tuple[Any, Any]]      # option (its dest) -> (value on the GPU, value with --cpu)

WORKLOAD_HELP = {"n_prompt": "-p tokens", "n_gen": "-n tokens", "reps": "repetitions inside each run"}
STUDY_HELP = {"runs": "engine runs per cell, all phases (baselines, search, confirmation)",
              "confirm": "confirmation rounds"}


def default_text(defaults: Defaults, dest: str) -> str:
    gpu, cpu = defaults[dest]
    return f"default {gpu}" + ("" if cpu == gpu else f"; {cpu} with --cpu")


def add_call_options(ap: argparse.ArgumentParser, *, name: str | None, workdir: Path, time_budget: float,
                     min_left: float, timeout: float, cpu_help: str, min_left_help: str = "a new run needs",
                     hardware_help: str = "") -> None:
    """What a benchmark run as one of several 10-minute device calls takes: where its state and report go, the
    call's time, and the dry run on this machine's CPU build. `name` None: the report's name is fixed (no
    --name)."""
    ap.add_argument("--cpu", action="store_true", help=f"dry run: {cpu_help}")
    ap.add_argument("--workdir", type=Path, help=f"state kept between calls (default {workdir})")
    ap.add_argument("--out", type=Path, help="report folder (default $OUT, else <workdir>/report)")
    if name is not None:
        ap.add_argument("--name", default=name, help=f"file stem of the report (default {name})")
    ap.add_argument("--timeout", type=float, default=timeout, help=f"seconds per engine run (default {timeout:g})")
    ap.add_argument("--time-budget", type=float, default=time_budget,
                    help=f"seconds this call may use (default {time_budget:g}, for a 600 s device command)")
    ap.add_argument("--min-left", type=float, default=min_left,
                    help=f"seconds {min_left_help} (default {min_left:g})")
    ap.add_argument("--hardware", default="gpu-box",
                    help="HardwareProfile of the predictions (default gpu-box" + (f"; {hardware_help})"
                                                                                   if hardware_help else ")"))


def add_workload_options(ap: argparse.ArgumentParser, defaults: Defaults, what: str = "",
                         prefix: str = "") -> None:
    """-p/-n/-r of the runs (`what` says which runs when a benchmark has several workloads; `prefix` names a
    second set, e.g. "tune-" for multi_gpu's study runs)."""
    for dest in ("n_prompt", "n_gen", "reps"):
        key = prefix.replace("-", "_") + dest
        ap.add_argument(f"--{prefix}{dest.replace('_', '-')}", type=int, dest=key,
                        help=f"{what + ': ' if what else ''}{WORKLOAD_HELP[dest]} ({default_text(defaults, key)})")


def add_study_options(ap: argparse.ArgumentParser, defaults: Defaults) -> None:
    """The tuner's study of each cell: its run cap, confirmation rounds, seed and candidate pool."""
    for dest in ("runs", "confirm"):
        ap.add_argument(f"--{dest}", type=int, help=f"{STUDY_HELP[dest]} ({default_text(defaults, dest)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool", type=int, default=200, help="candidates the cost model pre-screens (default 200)")


def add_step_options(ap: argparse.ArgumentParser, steps: tuple[str, ...], plans: str = "plans",
                     listed: str = "") -> None:
    """A benchmark made of named steps over a list of plans: which steps and plans, and measuring them again."""
    ap.add_argument("--steps", default=",".join(steps), help=f"comma list of {', '.join(steps)} (default all)")
    ap.add_argument("--plans", default="", help=f"comma list of {plans} to run (default all; --list shows them)")
    ap.add_argument("--list", action="store_true", help=f"list the {listed or plans} and exit")
    ap.add_argument("--redo", action="store_true", help="measure again what has results already")


def resolve(ap: argparse.ArgumentParser, args: argparse.Namespace, defaults: Defaults) -> argparse.Namespace:
    """Fill each option left unset from the table (the --cpu column with --cpu) and refuse a count below 1 (one
    line, exit 2, as argparse does)."""
    for dest, (gpu, cpu) in defaults.items():
        if getattr(args, dest, None) is None:
            setattr(args, dest, cpu if args.cpu else gpu)
        value = getattr(args, dest)
        if isinstance(value, int) and value < 1:
            ap.error(f"--{dest.replace('_', '-')} must be >= 1")
    return args


def parse_steps(ap: argparse.ArgumentParser, text: str, steps: tuple[str, ...]) -> list[str]:
    """--steps as a list; an unknown step is refused (exit 2)."""
    out = [s for s in text.split(",") if s]
    bad = [s for s in out if s not in steps]
    if bad:
        ap.error(f"unknown step {bad[0]!r}; steps: {', '.join(steps)}")
    return out


def parse_budgets(ap: argparse.ArgumentParser, text: str, flag: str = "--budgets") -> list[int]:
    """--budgets (or `flag`) as whole GiB; anything else is refused (exit 2)."""
    try:
        out = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        out = []
    if not out or any(b < 1 for b in out):
        ap.error(f"{flag} takes whole GiB, comma separated: {text!r}")
    return out



def copy_sqlite(db: Path, dest: Path) -> None:
    """A consistent copy of an SQLite database that may be open (sqlite3's backup), for a device call's state."""
    import sqlite3
    with sqlite3.connect(db) as src, sqlite3.connect(dest) as dst:
        src.backup(dst)


def pack_state(workdir: Path, db_name: str | None, dest: Path) -> None:
    """A resumable benchmark's state as one tar.gz: workdir/results (a file per result) and a consistent copy of
    its study database (`db_name`; None: results only); written under a temporary name and renamed, so a call cut
    off while it writes still brings the previous one back. A fresh machine goes on from `tar -xzf DEST -C
    WORKDIR`."""
    import tarfile
    import tempfile
    part = dest.with_name(dest.name + ".partial")
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(part, "w:gz") as tar:
        for p in sorted((workdir / "results").glob("*")):
            if p.is_file() and not p.name.endswith((".lock", ".tmp", ".partial")):
                tar.add(p, arcname=f"results/{p.name}")
        if db_name is not None and (workdir / db_name).exists():
            copy = Path(tmp) / db_name
            copy_sqlite(workdir / db_name, copy)
            tar.add(copy, arcname=db_name)
    part.replace(dest)
