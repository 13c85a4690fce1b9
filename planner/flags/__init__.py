"""llama.cpp / ik_llama.cpp command lines <-> Plans.

    render(plan, inv, tool="server") -> RenderedCommand     a list[str] argv (no program) with .env, .notes, .shell()
    render_shell(plan, inv, tool="server") -> str            env prefix, program, shell-quoted argv
    parse(args, inv, dialect) -> ParsedCommand               assignment, Knobs, warnings, raw overrides, ...
    assign(inv, n_gpu_layers, overrides, dialect, ...)       the matcher alone

A rendered command always parses back to the plan's exact assignment (render verifies it and raises FlagError
otherwise). Layout: common (regex dialect, matcher, -ngl slots, compaction), placement (plan -> -ngl/-ts/-ot),
cmdline (the tables' types, table-driven argv in/out), interpret (events -> ParsedCommand), render (Plan ->
RenderedCommand, verified), mainline and ik (the tables and the op-offload knobs of each dialect, per build),
hints (what to write instead of a flag a build does not read).
"""
from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from ..builds import PINNED, Build
from ..errors import FlagError
from ..model import ModelInventory
from ..plan import DIALECTS, Knobs, Plan
from . import ik, mainline
from .cmdline import (
    TOOLS, WARNINGS, DialectSpec, ParsedCommand, RenderedCommand, env_events, split_command, tool_of_binary, walk,
)
from .cmdline import knob_fields as _knob_fields
from .hints import Hints
from .interpret import interpret
from .render import render_plan
from .common import Override, assign, compile_pattern, int_set_regex, shell_join, slot_devices
from .placement import home_devices

__all__ = [
    "render", "render_shell", "parse", "assign", "home_devices", "knob_fields", "effective_min_batch",
    "RenderedCommand", "ParsedCommand", "Override", "WARNINGS", "SPECS", "int_set_regex", "compile_pattern",
    "slot_devices", "slot_rule", "placement_text", "PLACEMENT_FLAGS",
]

SPECS: dict[str, DialectSpec] = {"mainline": mainline.SPEC, "ik": ik.SPEC}


def _spec(dialect: str, build: Build | None = None) -> DialectSpec:
    if dialect not in SPECS:
        raise FlagError(f"unknown dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
    if build is None:
        return SPECS[dialect]
    if build.dialect != dialect:
        raise FlagError(f"build {build.describe()} is not a {dialect} build")
    return ik.spec_for(build) if dialect == "ik" else mainline.spec_for(build)


def _opts(dialect: str, build: Build | None, ik_op_table: str | None) -> dict[str, Any]:
    return {"ik_op_table": ik_op_table, "build": build or PINNED[dialect]}


def render(plan: Plan, inv: ModelInventory, tool: str = "server", *, ik_op_table: str | None = None,
           build: Build | None = None, bench: Any = None, model_path: str | None = None,
           cache_ram_mib: int | None = None) -> RenderedCommand:
    """Flags for `plan` in its dialect, for llama-server ("server"), llama-cli ("cli") or llama-bench ("bench").

    `build` (planner/builds.py; default the pinned build of the dialect) decides which flags exist and what they
    do; `ik_op_table` names the -op id table outright. `bench` (llama-bench only; anything with n_prompt, n_gen
    and optionally depth, repetitions) gives -p/-n/-d/-r; `model_path` adds -m; `cache_ram_mib` gives llama-server
    --cache-ram (its prompt cache in host RAM, planner/host.py) where the build has it. Raises FlagError for a plan
    the target cannot express (naming the knob), and when the rendered flags would not reproduce the plan exactly.
    """
    spec = _spec(plan.dialect, build)
    if tool not in TOOLS:
        raise FlagError(f"unknown tool {tool!r}; expected one of {', '.join(TOOLS)}")
    opts = {**_opts(plan.dialect, build, ik_op_table), "cache_ram_mib": cache_ram_mib}
    return render_plan(plan, inv, spec, tool, opts=opts, bench=bench, model_path=model_path,
                       parse_back=lambda rc: parse(rc, inv, plan.dialect, tool=tool, ik_op_table=ik_op_table,
                                                   build=build))


def render_shell(plan: Plan, inv: ModelInventory, tool: str = "server", *, binary: str | None = None,
                 **kw: Any) -> str:
    """One shell line: environment assignments (e.g. GGML_OP_OFFLOAD_MIN_BATCH=64), the program, quoted argv.

    `binary` defaults to the tool's program name (llama-server, llama-cli, llama-bench); "" leaves it out.
    """
    return render(plan, inv, tool, **kw).shell(binary)


# the flags of a rendered command that say where tensors go, and whether each takes a value (render's spellings)
PLACEMENT_FLAGS: dict[str, bool] = {"-ngl": True, "-ts": True, "-sm": True, "-mg": True, "-ot": True,
                                    "-cmoe": False, "-ncmoe": True}


def placement_text(plan: Plan, inv: ModelInventory) -> str:
    """The placement flags of the plan's llama-server command as render() emits them, shell-quoted: what names a
    placement so that the name matches its command (`-ngl 99 -cmoe` on a 48-layer model is emitted `-ngl 49
    -cmoe`; ik on two GPUs says `-ot exps=CPU`). Raises FlagError as render() does."""
    argv, out, i = render(plan, inv, "server"), [], 0
    while i < len(argv):
        n = 1 + PLACEMENT_FLAGS[argv[i]] if argv[i] in PLACEMENT_FLAGS else 0
        out += argv[i:i + n]
        i += n or 1
    return shell_join(out)


def parse(args: Sequence[str] | str | RenderedCommand, inv: ModelInventory, dialect: str, *,
          tool: str | None = None, n_gpus: int | None = None, ik_op_table: str | None = None,
          build: Build | None = None) -> ParsedCommand:
    """Read a command line as pasted (a string, with or without env assignments and the program) or an argv list.

    The tool comes from `tool`, else the program name, else "server". `n_gpus` (else inferred from -ts, -ot,
    -dev and CUDA_VISIBLE_DEVICES) bounds the valid CUDAn names. Raises FlagError for what llama.cpp would reject.
    """
    spec = _spec(dialect, build)
    env, binary, argv = split_command(args)
    if tool is None:
        if isinstance(args, RenderedCommand):
            tool = args.tool
        elif binary is not None:
            tool = tool_of_binary(binary)
        else:
            tool = "server"
    if tool not in spec.tools:
        raise FlagError(f"unknown tool {tool!r}; expected one of {', '.join(spec.tools)}")
    table = spec.tools[tool]
    warnings: list[str] = []
    other = "ik" if dialect == "mainline" else "mainline"
    hints = Hints(dialect, build or PINNED[dialect], SPECS[dialect].tools[tool], SPECS[other].tools[tool])
    events = env_events(env, table, warnings) + walk(argv, table, warnings, hints)
    return interpret(events, env, inv, spec, table, warnings, n_gpus, _opts(dialect, build, ik_op_table))


def slot_rule(dialect: str, build: Build | None = None) -> str:
    """How `build` (default: the pinned one) counts -ngl: mainline's output layer first only since PR 18148."""
    return _spec(dialect, build).slot_rule


def knob_fields(dialect: str, tool: str) -> frozenset[str]:
    """Knobs fields a command line of this dialect and tool can set (the rest stay at their defaults)."""
    spec = _spec(dialect)
    return _knob_fields(spec, tool) - spec.tools[tool].ignored_knobs


def effective_min_batch(knobs: Knobs, op_class: str, dialect: str, inv: ModelInventory) -> int:
    """Batch from which an op of `op_class` on a RAM-resident weight runs on the GPU.

    mainline: the op rule's min_batch. ik: the same for dense ops; MoE ops (moe_matmul, moe_fused_up_gate) need
    min_batch * n_expert / n_expert_used (docs/llamacpp.md section 4: DeepSeek-V3 1024 at the default 32).
    """
    mb = knobs.offload.rule(op_class).min_batch
    if dialect == "ik" and op_class in ("moe_matmul", "moe_fused_up_gate"):
        hp = inv.hparams
        return ik.moe_offload_threshold(mb, hp.n_expert, hp.n_expert_used)
    return mb

