"""What more than one command uses: JSON out, hardware and budget checks, the target build, the
layer table, the engine lookup (planner.engines' registry), the report writer and the shared options."""
from __future__ import annotations

import argparse
import json
import sys

from .. import engines
from ..builds import Build, parse_build
from ..errors import InputError
from ..hardware import HardwareProfile, resolve
from ..options import EngineOptions


def _emit_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _hardware(args: argparse.Namespace, required: bool = True) -> HardwareProfile | None:
    hw = resolve(getattr(args, "hardware", None), getattr(args, "gpu", None))
    if hw is not None:
        return hw
    if required:
        raise InputError("say what GPUs there are: --gpu 24GiB[,24GiB] or --hardware PROFILE")
    return None


def _positive(v: int, flag: str) -> int:
    if v <= 0:
        raise InputError(f"{flag} must be positive, got {v}")
    return v


def _nonneg(v: int, flag: str) -> int:
    if v < 0:
        raise InputError(f"{flag} must be >= 0, got {v}")
    return v


def _target_build(args: argparse.Namespace) -> Build:
    """--build DIALECT:N, or the path of a llama.cpp program (its --help and --version say), else pinned."""
    spec = getattr(args, "build", None)
    if spec and ("/" in spec or spec.startswith(".")):
        build = engines.runtime("build_of_binary")(spec)    # the CLI is where planner and runtime meet
        if build.dialect != args.dialect:
            raise InputError(f"--build {spec} is a {build.dialect} program; say --dialect {build.dialect}")
        return build
    return parse_build(spec, args.dialect)


def layer_summary(inv, assignment: dict[str, str]) -> list[dict]:
    """Runs of consecutive layers with the same placement pattern: home device and where experts sit."""
    from ..flags import home_devices
    homes = home_devices(assignment, inv)
    rows: list[dict] = []
    for il in range(inv.n_layer):
        tensors = [t for t in inv.by_layer.get(il, ()) if t.role != "nextn"]
        if not tensors:
            continue
        home = homes[il] or "CPU"
        others = sorted({assignment.get(t.name, "CPU") for t in tensors if not t.is_expert})
        exps = {}
        for t in tensors:
            if t.is_expert and t.name.endswith(".weight"):
                exps[t.role.replace("exps_", "")] = assignment.get(t.name, "CPU")
        key = (home, tuple(others), tuple(sorted(exps.items())))
        if rows and rows[-1]["key"] == key and rows[-1]["last"] == il - 1:
            rows[-1]["last"] = il
        else:
            rows.append({"key": key, "first": il, "last": il, "home": home, "dense": others, "experts": exps})
    for r in rows:
        r.pop("key")
    return rows


def _print_layers(inv, assignment: dict[str, str]) -> None:
    from ..tables import table
    out_dev = assignment.get("output.weight", assignment.get("output_norm.weight", "CPU"))
    rows = [["token_embd", assignment.get("token_embd.weight", "CPU"), "-"], ["output", out_dev, "-"]]
    for r in layer_summary(inv, assignment):
        span = f"blk {r['first']}" if r["first"] == r["last"] else f"blk {r['first']}-{r['last']}"
        exps = ", ".join(f"{k}:{v}" for k, v in r["experts"].items()) or "-"
        rows.append([span, "/".join(r["dense"]), exps])
    print(table(["layers", "attn+dense on", "experts (up/gate/down)"], rows, right=set()))


def load_engine(opts: EngineOptions, hw: HardwareProfile):
    """The Engine `opts` names, made through planner.engines' registry (one line and exit 2 for an engine this
    install or machine cannot run)."""
    return engines.make_engine(opts, hw)


def _cuda_available() -> bool:
    return engines.runtime("cuda_available")()   # torch lives in runtime/, imported only there


def _write_report(study, out):
    from ..tuner.report import write_study_report
    try:
        return write_study_report(study, out)
    except OSError as e:
        raise InputError(f"cannot write the report to {out}: {e.strerror or e}") from e


def _add_hw(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--gpu", help="GPU memory per GPU, e.g. 24GiB or 24GiB,16GiB (a generic desktop otherwise)")
    p.add_argument("--hardware", help="hardware preset name or calibrated JSON (offload-tuner calibrate)")


def _add_build(p: argparse.ArgumentParser) -> None:
    p.add_argument("--build", metavar="DIALECT:N|PATH", help="the engine build the printed lines are for, as "
                   "`llama-server --version` numbers it (e.g. ik:4840, mainline:10114), or the path of the program "
                   "(its --help and --version are read); default: the pinned builds (ik 8337e4cd = 4840, mainline "
                   "as in llama-cpp-python 0.3.36)")
