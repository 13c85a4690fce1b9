"""offload-tuner command line: argparse entry point wiring the planner (and, lazily, the runtime).

Results go to stdout (tables, or JSON with --json); logs to stderr. Expected errors print one line and exit 2.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace

from .errors import InputError
from .hardware import HardwareProfile, fmt_bytes, from_gpu_sizes, load_hardware, parse_size
from .plan import DIALECTS, KV_TYPES, Knobs, Plan

DEMO_MODEL = "preset:Qwen3-30B-A3B:Q4_K_M"
DEMO_GPU = "16GiB"
TOOLS = ("server", "cli", "bench")


# ---- shared pieces --------------------------------------------------------------------------------------------

def _emit_json(obj: object) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _hardware(args: argparse.Namespace, required: bool = True) -> HardwareProfile | None:
    if getattr(args, "hardware", None):
        hw = load_hardware(args.hardware)
        return hw.with_vram([parse_size(s) for s in args.gpu.split(",")]) if args.gpu else hw
    if getattr(args, "gpu", None):
        return from_gpu_sizes(args.gpu)
    if required:
        raise InputError("say what GPUs there are: --gpu 24GiB[,24GiB] or --hardware PROFILE")
    return None


def _knobs(args: argparse.Namespace) -> Knobs:
    k = Knobs()
    if args.ctx is not None:
        k = replace(k, n_ctx=_positive(args.ctx, "--ctx"))
    if args.ubatch is not None:
        ub = _positive(args.ubatch, "--ubatch")
        k = replace(k, n_ubatch=ub, n_batch=max(k.n_batch, ub))
    if args.batch is not None:
        k = replace(k, n_batch=_positive(args.batch, "--batch"))
    if args.kv_type:
        k = replace(k, type_k=args.kv_type, type_v=args.kv_type)
    if args.threads is not None:
        k = replace(k, n_threads=_positive(args.threads, "--threads"))
    return k


def _positive(v: int, flag: str) -> int:
    if v <= 0:
        raise InputError(f"{flag} must be positive, got {v}")
    return v


def _model_path(model: str) -> str:
    return "MODEL.gguf" if model.startswith("preset:") else model


def commands_for(plan: Plan, inv, model: str) -> dict[str, str]:
    """Ready-to-paste command lines per tool, shell-quoted, with -m and any environment prefix."""
    from .flags import render_shell
    return {f"llama-{tool}": render_shell(plan, inv, tool, model_path=_model_path(model)) for tool in TOOLS}


def layer_summary(inv, assignment: dict[str, str]) -> list[dict]:
    """Runs of consecutive layers with the same placement pattern: home device and where experts sit."""
    rows: list[dict] = []
    for il in range(inv.n_layer):
        tensors = [t for t in inv.by_layer.get(il, ()) if t.role != "nextn"]
        if not tensors:
            continue
        home = assignment.get(f"blk.{il}.attn_norm.weight", "CPU")
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
    from .report import table
    out_dev = assignment.get("output.weight", assignment.get("output_norm.weight", "CPU"))
    rows = [["token_embd", assignment.get("token_embd.weight", "CPU"), "-"], ["output", out_dev, "-"]]
    for r in layer_summary(inv, assignment):
        span = f"blk {r['first']}" if r["first"] == r["last"] else f"blk {r['first']}-{r['last']}"
        exps = ", ".join(f"{k}:{v}" for k, v in r["experts"].items()) or "-"
        rows.append([span, "/".join(r["dense"]), exps])
    print(table(["layers", "attn+dense on", "experts (up/gate/down)"], rows, right=set()))


# ---- commands -------------------------------------------------------------------------------------------------

def cmd_inspect(args: argparse.Namespace) -> int:
    from .loader import load_model
    from .report import inventory_summary, table
    inv = load_model(args.model)
    hp = inv.hparams
    groups = inv.groups()
    per_layer = []
    for il in range(inv.n_layer):
        ts = inv.by_layer.get(il, ())
        per_layer.append({"layer": il, "bytes": sum(t.nbytes for t in ts),
                          "expert_bytes": sum(t.nbytes for t in ts if t.is_expert),
                          "nextn": any(t.role == "nextn" for t in ts)})
    if args.json:
        _emit_json({"model": inv.name, "source": inv.source, "arch": inv.arch,
                    "hparams": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(hp).items()},
                    "n_tensors": len(inv.tensors), "total_bytes": inv.total_bytes(),
                    "active_bytes_per_token": inv.active_bytes_per_token(), "tied_output": inv.tied_output,
                    "groups": groups, "layers": per_layer})
        return 0
    print(inventory_summary(inv))
    print(f"tensors: {len(inv.tensors)}; weights read per token: {fmt_bytes(inv.active_bytes_per_token())}"
          + ("; output tied to token_embd" if inv.tied_output else ""))
    print(f"n_embd {hp.n_embd}, n_head {hp.n_head}, n_head_kv {max(hp.n_head_kv)}, head_dim {hp.head_dim_k}/{hp.head_dim_v}, "
          f"vocab {hp.n_vocab}, ctx_train {hp.n_ctx_train}"
          + (f", MLA kv_lora_rank {hp.mla_kv_lora_rank}" if hp.is_mla else "")
          + (f", SWA window {hp.n_swa} on {sum(hp.swa_layers)} layers" if hp.n_swa else ""))
    print()
    print(table(["group", "bytes"], [[g, fmt_bytes(b)] for g, b in sorted(groups.items(), key=lambda x: -x[1])]))
    print()
    runs: list[list[object]] = []
    for row in per_layer:
        desc = (fmt_bytes(row["bytes"]), fmt_bytes(row["expert_bytes"]), "nextn (not loaded)" if row["nextn"] else "")
        if runs and runs[-1][2:] == list(desc) and runs[-1][1] == row["layer"] - 1:
            runs[-1][1] = row["layer"]
        else:
            runs.append([row["layer"], row["layer"], *desc])
    print(table(["layers", "bytes per layer", "experts", "note"],
                [[f"{a}" if a == b else f"{a}-{b}", x, y, z] for a, b, x, y, z in runs]))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from .loader import load_model
    from .memory import estimate
    from .propose import Budget, best_plans
    from .report import inventory_summary, memory_table, table
    inv = load_model(args.model)
    hw = _hardware(args)
    knobs = _knobs(args)
    margin = parse_size(args.margin)
    ranked = best_plans(inv, hw, knobs, args.dialect, args.objective, margin)
    best = ranked[0]
    budget = Budget.from_hardware(hw, margin)
    cmds = commands_for(best.plan, inv, args.model)
    if args.json:
        _emit_json({"model": inv.name, "hardware": hw.name, "objective": args.objective,
                    "plan": best.plan.to_dict(), "plan_id": best.plan.id, **estimate(inv, best.plan, hw).to_dict(),
                    "budgets": budget.gpus, "predicted": {"pp_tps": best.pp_tps, "tg_tps": best.tg_tps},
                    "commands": cmds,
                    "alternatives": [{"label": s.plan.label, "plan_id": s.plan.id, "pp_tps": s.pp_tps, "tg_tps": s.tg_tps,
                                      "mmap": s.plan.knobs.mmap, "op_offload": s.plan.knobs.offload.any_enabled,
                                      "gpu_bytes": {d: m.total for d, m in s.memory.devices.items() if d != "CPU"}}
                                     for s in ranked[1:]]})
        return 0
    print(f"model:    {inventory_summary(inv)}")
    gpus = ", ".join(f"{g.name} {fmt_bytes(g.vram_bytes)}" for g in hw.gpus)
    print(f"hardware: {hw.name}: {gpus}; host {hw.host.mem_bw / 1e9:.0f} GB/s, PCIe {hw.link.h2d_pinned / 1e9:.0f} GB/s pinned")
    print(f"best ({args.objective}): {best.plan.label}, op offload {'on' if best.plan.knobs.offload.any_enabled else 'off'}, "
          f"{'mmap' if best.plan.knobs.mmap else '--no-mmap'} -> predicted PP {best.pp_tps:.1f} t/s, TG {best.tg_tps:.2f} t/s")
    print()
    _print_layers(inv, best.plan.assignment)
    print()
    print(memory_table(best.memory, budget.gpus))
    print()
    for tool, line in cmds.items():
        print(f"{tool}:\n  {line}")
    print()
    rows = [[s.plan.label, "on" if s.plan.knobs.offload.any_enabled else "off", "yes" if s.plan.knobs.mmap else "no",
             " ".join(fmt_bytes(m.total) for d, m in sorted(s.memory.devices.items()) if d != "CPU"),
             f"{s.pp_tps:.1f}", f"{s.tg_tps:.2f}"] for s in ranked[: args.top]]
    print(table(["candidate", "op offload", "mmap", "GPU total", "PP t/s", "TG t/s"], rows))
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .cost import predict
    from .flags import parse
    from .loader import load_model
    from .memory import estimate
    from .report import inventory_summary, memory_table
    inv = load_model(args.model)
    if not args.llama_args:
        raise InputError("give the llama.cpp arguments after --, e.g. explain MODEL -- -ngl 99 -ot exps=CPU")
    parsed = parse(args.llama_args, inv, args.dialect)
    plan = Plan(inv.source or inv.name, parsed.assignment, parsed.knobs, args.dialect, "explained")
    n_gpus = max([int(d[4:]) + 1 for d in plan.assignment.values() if d.startswith("CUDA")] or [0])
    hw = _hardware(args, required=False)
    if hw is None:
        hw = from_gpu_sizes(",".join(["24GiB"] * max(n_gpus, 1)))
    mem = estimate(inv, plan, hw)
    pred = predict(inv, plan, hw)
    warnings = list(parsed.warnings)
    if plan.knobs.no_kv_offload:
        pass   # the parser already warns
    for dev, m in mem.devices.items():
        if dev != "CPU" and int(dev[4:]) < len(hw.gpus) and m.total > hw.gpu(dev).vram_bytes:
            warnings.append(f"W100 {dev} needs {fmt_bytes(m.total)} but has {fmt_bytes(hw.gpu(dev).vram_bytes)}: "
                            "this command would run out of memory")
    if args.json:
        _emit_json({"model": inv.name, "dialect": args.dialect, "hardware": hw.name, "plan": plan.to_dict(),
                    **mem.to_dict(), "predicted": {"pp_tps": pred.pp_tps, "tg_tps": pred.tg_tps},
                    "layers": layer_summary(inv, plan.assignment), "warnings": warnings})
        return 0
    print(f"model:    {inventory_summary(inv)}")
    print(f"dialect:  {args.dialect}; hardware for the prediction: {hw.name}")
    print()
    _print_layers(inv, plan.assignment)
    print()
    print(memory_table(mem, {f"CUDA{i}": g.vram_bytes for i, g in enumerate(hw.gpus)}))
    print()
    print(f"predicted: PP {pred.pp_tps:.1f} t/s, TG {pred.tg_tps:.2f} t/s")
    for w in warnings:
        print(f"warning: {w}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from runtime.synth import synth_main
    return synth_main(args) or 0


def cmd_demo(args: argparse.Namespace) -> int:
    print(f"# offload-tuner demo: plan {DEMO_MODEL} on a {DEMO_GPU} GPU with dual-channel DDR5", flush=True)
    ns = argparse.Namespace(model=DEMO_MODEL, gpu=DEMO_GPU, hardware=None, ctx=8192, ubatch=None, batch=None,
                            kv_type=None, threads=None, dialect="mainline", objective="tg", margin="512MiB",
                            json=False, top=8)
    cmd_plan(ns)
    print()
    user = ["-ngl", "99", "-ot", r"blk\.(1[0-9]|[0-9])\.ffn_.*_exps=CPU", "-c", "8192", "-ub", "1024"]
    print(f"# and what a hand-written command does: explain {DEMO_MODEL} -- {shlex.join(user)}", flush=True)
    return cmd_explain(argparse.Namespace(model=DEMO_MODEL, dialect="mainline", gpu=DEMO_GPU, hardware=None,
                                          json=False, llama_args=user))


# ---- argparse -------------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):   # one line, exit 2 (argparse's default prints usage first)
        raise InputError(f"{self.prog}: {message}")


def _add_hw(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--gpu", help="GPU memory per GPU, e.g. 24GiB or 24GiB,16GiB (a generic desktop otherwise)")
    p.add_argument("--hardware", help="hardware preset name or calibrated JSON (offload-tuner calibrate)")


def _add_knobs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ctx", type=int, default=8192, help="context length (default 8192)")
    p.add_argument("--ubatch", type=int, help="-ub (default 512)")
    p.add_argument("--batch", type=int, help="-b (default 2048, at least --ubatch)")
    p.add_argument("--kv-type", choices=KV_TYPES, help="KV cache type for K and V (default f16)")
    p.add_argument("--threads", type=int, help="-t (default: the hardware's cores)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="offload-tuner", description="Find the fastest GPU+RAM placement for MoE GGUF models in llama.cpp")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("inspect", help="hparams, tensor groups, bytes per group and per layer")
    p.add_argument("model", help="path to a .gguf (first shard of a split) or preset:NAME[:QUANT]")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("plan", help="best predicted placement, flags, memory per device, predicted PP/TG")
    p.add_argument("model")
    _add_hw(p, True)
    _add_knobs(p)
    p.add_argument("--dialect", choices=DIALECTS, default="mainline")
    p.add_argument("--objective", choices=("tg", "pp", "balanced"), default="tg")
    p.add_argument("--margin", default="512MiB", help="VRAM kept free per GPU (default 512MiB)")
    p.add_argument("--top", type=int, default=8, help="candidates to list")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("explain", help="what a llama.cpp command line does: placement, memory, speed, warnings")
    p.add_argument("model")
    p.add_argument("--dialect", choices=DIALECTS, default="mainline")
    _add_hw(p, False)
    p.add_argument("--json", action="store_true")
    p.epilog = "then -- and the llama.cpp arguments, e.g. explain MODEL -- -ngl 99 -cmoe"
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("synth", help="write a synthetic GGUF that llama.cpp loads")
    from runtime.synth import add_synth_arguments   # cli.py is where planner and runtime meet
    add_synth_arguments(p)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("demo", help="the main job on the embedded default (no GPU or llama.cpp needed)")
    p.set_defaults(func=cmd_demo)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        # everything after the first "--" belongs to llama.cpp (explain), never to our own parser
        cut = argv.index("--") if "--" in argv else len(argv)
        args = build_parser().parse_args(argv[:cut])
        args.llama_args = argv[cut + 1:]
        return args.func(args) or 0
    except InputError as e:
        print(f"offload-tuner: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        print("offload-tuner: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
