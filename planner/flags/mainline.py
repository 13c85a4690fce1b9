"""Mainline llama.cpp: flag tables for llama-server, llama-cli and llama-bench, and the op-offload knobs.

Source: llama.cpp vendored in llama-cpp-python 0.3.36 (commit 0c1e57098): common/arg.cpp (server/cli flags,
env variables), common/common.h (LLM_FFN_EXPS_REGEX, llm_ffn_block_regex), tools/llama-bench/llama-bench.cpp
(its own parser: ',' = alternative values, ';' between overrides of one -ot set, '/' or ';' between -ts
proportions), ggml/src/ggml-cuda/ggml-cuda.cu (GGML_OP_OFFLOAD_MIN_BATCH, default 32). Where this disagrees with
docs/llamacpp.md the source wins (e.g. there is no --no-mmap: it is `-lm none`).
"""
from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from typing import Any
from collections.abc import Mapping, Sequence

from ..builds import Build, Feature, Spelling
from ..errors import FlagError
from ..model import ModelInventory
from ..plan import DEFAULT_MIN_BATCH, KV_TYPES, OP_CLASSES, Knobs, OffloadPolicy
from ._mainline_args import KNOWN_ARGS
from .cmdline import FALSEY, TRUTHY, DialectSpec, Event, Flag, MoeRule, ToolTable, for_build

_ONOFF = {**{w: True for w in TRUTHY}, **{w: False for w in FALSEY}}
_FA = {**_ONOFF, "auto": None, "-1": None}     # common_arg_utils::is_autoy
_LOAD_MODE = {"auto": True, "mmap": True, "mmap+mlock": True, "none": False, "mlock": False, "dio": False}
_BOOL01_INV = {"0": True, "1": False}          # -nkvo 1 / -nopo 1 turn a default-on feature off

# common/common.h: LLM_FFN_EXPS_REGEX, LLM_FFN_DENSE_REGEX, llm_ffn_block_regex = "blk\\.%d" + regex
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
FFN_DENSE_REGEX = r"\.ffn_(up|down|gate)\."
ENV_MIN_BATCH = "GGML_OP_OFFLOAD_MIN_BATCH"

_COMMON_FLAGS: tuple[Flag, ...] = (
    Flag("model", ("-m", "--model"), env="LLAMA_ARG_MODEL"),
    Flag("ngl", ("-ngl", "--gpu-layers", "--n-gpu-layers"), "ngl", env="LLAMA_ARG_N_GPU_LAYERS"),
    Flag("ts", ("-ts", "--tensor-split"), env="LLAMA_ARG_TENSOR_SPLIT"),
    Flag("sm", ("-sm", "--split-mode"), "choice", choices={m: m for m in ("none", "layer", "row", "tensor")},
         render_as={m: m for m in ("none", "layer", "row", "tensor")}, env="LLAMA_ARG_SPLIT_MODE"),
    Flag("mg", ("-mg", "--main-gpu"), "int", env="LLAMA_ARG_MAIN_GPU"),
    Flag("dev", ("-dev", "--device"), env="LLAMA_ARG_DEVICE"),
    Flag("ot", ("-ot", "--override-tensor"), env="LLAMA_ARG_OVERRIDE_TENSOR", since=Spelling.OVERRIDE_TENSOR),
    Flag("cmoe", ("-cmoe", "--cpu-moe"), "switch", env="LLAMA_ARG_CPU_MOE", env_kind="void", since=Spelling.CPU_MOE),
    Flag("ncmoe", ("-ncmoe", "--n-cpu-moe"), "int", env="LLAMA_ARG_N_CPU_MOE", since=Spelling.N_CPU_MOE),
    Flag("ncffn", ("-ncffn", "--n-cpu-ffn"), "int", env="LLAMA_ARG_N_CPU_FFN"),
    Flag("ctx", ("-c", "--ctx-size"), "int", env="LLAMA_ARG_CTX_SIZE"),
    Flag("np", ("-np", "--parallel"), "int", env="LLAMA_ARG_N_PARALLEL"),
    Flag("fit", ("-fit", "--fit"), "choice", choices=_ONOFF, render_as={True: "on", False: "off"}, env="LLAMA_ARG_FIT",
         since=Spelling.FIT),
    Flag("fitt", ("-fitt", "--fit-target"), env="LLAMA_ARG_FIT_TARGET", since=Spelling.FIT_TARGET),
    Flag("batch", ("-b", "--batch-size"), "int", env="LLAMA_ARG_BATCH"),
    Flag("ubatch", ("-ub", "--ubatch-size"), "int", env="LLAMA_ARG_UBATCH"),
    Flag("fa", ("-fa", "--flash-attn"), "choice", choices=_FA, render_as={True: "on", False: "off"},
         env="LLAMA_ARG_FLASH_ATTN", since=Spelling.FA_VALUE),
    Flag("ctk", ("-ctk", "--cache-type-k"), env="LLAMA_ARG_CACHE_TYPE_K"),
    Flag("ctv", ("-ctv", "--cache-type-v"), env="LLAMA_ARG_CACHE_TYPE_V"),
    Flag("threads", ("-t", "--threads"), "int", env="LLAMA_ARG_THREADS"),
    Flag("kv_offload", ("-nkvo", "--no-kv-offload"), "switch", const=False),
    Flag("kv_offload", ("-kvo", "--kv-offload"), "switch", const=True, env="LLAMA_ARG_KV_OFFLOAD", env_kind="bool",
         since=Spelling.NEGATED),
    Flag("mmap", ("-lm", "--load-mode"), "choice", choices=_LOAD_MODE, render_as={False: "none", True: "mmap"},
         env="LLAMA_ARG_LOAD_MODE", since=Spelling.LOAD_MODE),
    Flag("swa_full", ("--swa-full",), "switch", env="LLAMA_ARG_SWA_FULL", env_kind="void", since=Spelling.SWA_FULL),
    Flag("op_offload", ("--no-op-offload",), "switch", const=False, since=Spelling.NO_OP_OFFLOAD),
    Flag("op_offload", ("--op-offload",), "switch", const=True, since=Spelling.NEGATED),
    Flag("no_host", ("--no-host",), "switch", const=True, env="LLAMA_ARG_NO_HOST", env_kind="void",
         since=Spelling.NO_HOST),
    # llama-server's prompt cache in host RAM, MiB (8192 by default; -1 no limit, 0 off): not a Knobs field, a plan
    # emits it sized to the RAM its weights leave (planner/host.py cache_ram_for; ParsedCommand.cache_ram_mib)
    Flag("cache_ram", ("--cache-ram", "-cram"), "int", env="LLAMA_ARG_CACHE_RAM", since=Spelling.CACHE_RAM),
)

_BENCH_FLAGS: tuple[Flag, ...] = (
    Flag("model", ("-m", "--model"), sweep=True),
    Flag("n_prompt", ("-p", "--n-prompt"), "int", sweep=True),
    Flag("n_gen", ("-n", "--n-gen"), "int", sweep=True),
    Flag("depth", ("-d", "--n-depth"), "int", sweep=True),
    Flag("batch", ("-b", "--batch-size"), "int", sweep=True),
    Flag("ubatch", ("-ub", "--ubatch-size"), "int", sweep=True),
    Flag("ctk", ("-ctk", "--cache-type-k"), sweep=True),
    Flag("ctv", ("-ctv", "--cache-type-v"), sweep=True),
    Flag("threads", ("-t", "--threads"), "int", sweep=True),
    Flag("ngl", ("-ngl", "--n-gpu-layers"), "ngl", sweep=True),
    Flag("ncmoe", ("-ncmoe", "--n-cpu-moe"), "int", sweep=True, since=Spelling.BENCH_N_CPU_MOE),
    Flag("sm", ("-sm", "--split-mode"), "choice", choices={m: m for m in ("none", "layer", "row", "tensor")},
         render_as={m: m for m in ("none", "layer", "row", "tensor")}, sweep=True),
    Flag("mg", ("-mg", "--main-gpu"), "int", sweep=True),
    Flag("dev", ("-dev", "--device"), sweep=True),
    Flag("kv_offload", ("-nkvo", "--no-kv-offload"), "choice", choices=_BOOL01_INV, render_as={True: "0", False: "1"},
         sweep=True),
    Flag("fa", ("-fa", "--flash-attn"), "choice", choices=_FA, render_as={True: "1", False: "0"}, sweep=True,
         since=Spelling.BENCH_FA_VALUE),
    Flag("mmap", ("-lm", "--load-mode"), "choice", choices=_LOAD_MODE, render_as={False: "none", True: "mmap"},
         sweep=True, since=Spelling.LOAD_MODE),
    Flag("op_offload", ("-nopo", "--no-op-offload"), "choice", choices=_BOOL01_INV,
         render_as={True: "0", False: "1"}, sweep=True, since=Spelling.NO_OP_OFFLOAD),
    Flag("no_host", ("--no-host",), "choice", choices={"0": False, "1": True}, render_as={True: "1", False: "0"},
         sweep=True, since=Spelling.NO_HOST),
    Flag("ts", ("-ts", "--tensor-split")),
    Flag("ot", ("-ot", "--override-tensor"), since=Spelling.BENCH_OVERRIDE_TENSOR),
    Flag("reps", ("-r", "--repetitions"), "int"),
    Flag("fitt", ("-fitt", "--fit-target"), sweep=True, since=Spelling.BENCH_FIT_TARGET),
)
# Every other llama-bench option (tools/llama-bench/llama-bench.cpp parse_cmd_params) -> number of values.
_BENCH_KNOWN: dict[str, int] = {
    **{s: 0 for s in ("-h", "--help", "--version", "--offline", "--list-devices", "-v", "--verbose", "--progress",
                      "--no-warmup")},
    **{s: 1 for s in ("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hft", "--hf-token", "-pg", "-C",
                      "--cpu-mask", "--cpu-strict", "--poll", "-rpc", "--rpc", "-lzm", "--lazy-mode", "--numa",
                      "-embd", "--embeddings", "--repack", "--prio", "--delay", "-o", "--output",
                      "-oe", "--output-err", "-fitc", "--fit-ctx")},
}

_SERVER_MOE = MoeRule(ncmoe_template="blk\\.{i}" + FFN_EXPS_REGEX, cmoe_pattern=FFN_EXPS_REGEX,
                      order="first_layers", placement="cmdline", accumulate=True,
                      ncffn_template="blk\\.{i}" + FFN_DENSE_REGEX)
# llama-bench appends its -ncmoe patterns after the user's -ot set (cmd_params_instance::to_llama_mparams).
_BENCH_MOE = MoeRule(ncmoe_template="blk\\.{i}" + FFN_EXPS_REGEX, cmoe_pattern=None, order="first_layers",
                     placement="after_user", accumulate=False)

_SERVER_DEFAULTS: dict[str, Any] = {
    "ngl": -1, "ctx": None, "np": -1, "fit": True, "batch": 2048, "ubatch": 512, "fa": None, "ctk": "f16",
    "ctv": "f16", "threads": 0, "kv_offload": True, "mmap": True, "swa_full": False, "op_offload": True,
    "no_host": False,
}
_BENCH_DEFAULTS: dict[str, Any] = {
    "ngl": -1, "batch": 2048, "ubatch": 512, "fa": None, "ctk": "f16", "ctv": "f16", "threads": 0,
    "kv_offload": True, "mmap": True, "op_offload": True, "n_prompt": 512, "n_gen": 128, "depth": 0, "reps": 5,
    "no_host": False,
}


def _table(tool: str) -> ToolTable:
    if tool == "bench":
        return ToolTable(
            dialect="mainline", tool="bench", binary="llama-bench", flags=_BENCH_FLAGS, known=_BENCH_KNOWN,
            strict=True, ot_sep=";", ts_sep="/", ts_split=r"[;/]+", int_ranges=True, defaults=_BENCH_DEFAULTS,
            always=frozenset({"ngl", "batch", "ubatch", "fa"}),
            ignored_knobs=frozenset({"n_ctx", "n_seq", "swa_full"}),
            kv_types=tuple(t for t in KV_TYPES if t != "f32"), moe=_BENCH_MOE)
    return ToolTable(
        dialect="mainline", tool=tool, binary=f"llama-{tool}", flags=_COMMON_FLAGS, known=KNOWN_ARGS[tool],
        strict=True, ot_sep=",", ts_sep=",", ts_split=r"[,/]+", int_ranges=False,
        defaults={**_SERVER_DEFAULTS, "np": -1 if tool == "server" else 1},
        always=frozenset({"ngl", "ctx", "np", "batch", "ubatch", "fa"}), ignored_knobs=frozenset(),
        kv_types=KV_TYPES, moe=_SERVER_MOE)


TABLES: dict[str, ToolTable] = {tool: _table(tool) for tool in ("server", "cli", "bench")}


def render_policy(knobs: Knobs, table: ToolTable, inv: ModelInventory, opts: Mapping[str, Any]
                  ) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """mainline has one switch (--no-op-offload / -nopo 1) and one process-wide min batch (environment)."""
    pol = knobs.offload
    rules = {op: pol.rule(op) for op in OP_CLASSES}
    enabled = {r.enabled for r in rules.values()}
    if len(enabled) > 1:
        on = [op for op, r in rules.items() if r.enabled]
        raise FlagError(f"mainline cannot offload some op classes only (knob offload: {', '.join(on)} on, the rest "
                        "off); it has one switch, --no-op-offload. Use --dialect ik (-op) or make them equal")
    batches = {r.min_batch for r in rules.values()}
    if len(batches) > 1:
        raise FlagError(f"mainline cannot use a different offload min_batch per op class (knob offload.*.min_batch "
                        f"= {sorted(batches)}); it has one, {ENV_MIN_BATCH}. Use --dialect ik or make them equal")
    if not knobs.only_active_experts:
        raise FlagError("mainline always uploads only the active experts (knob only_active_experts=False is "
                        "ik's -no-ooae); use --dialect ik")
    settings: list[tuple[str, Any]] = []
    if not enabled.pop():
        settings.append(("op_offload", False))
    mb = batches.pop()
    build = opts.get("build")
    if mb != DEFAULT_MIN_BATCH and build is not None and not build.accepts(Spelling.MIN_BATCH_ENV):
        raise FlagError(f"{build.lacks(Spelling.MIN_BATCH_ENV)}: it offloads ops from batch {DEFAULT_MIN_BATCH}, so it "
                        f"cannot run knob offload min_batch={mb}")
    env = {ENV_MIN_BATCH: str(mb)} if mb != DEFAULT_MIN_BATCH else {}
    return settings, env


def _atoi(text: str) -> int:
    """C atoi: leading whitespace, optional sign, digits; 0 when there are none."""
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


def parse_policy(settings: Mapping[str, Any], events: Sequence[Event], env: Mapping[str, str], table: ToolTable,
                 warnings: list[str], opts: Mapping[str, Any]) -> tuple[OffloadPolicy, bool]:
    enabled = bool(settings.get("op_offload", True))
    mb = DEFAULT_MIN_BATCH
    if ENV_MIN_BATCH in env:
        raw = env[ENV_MIN_BATCH]
        mb = _atoi(raw)
        if raw.strip() != str(mb):
            warnings.append(f"W023 {ENV_MIN_BATCH}={raw!r}: ggml reads it with atoi, i.e. {mb}")
    return OffloadPolicy.all(enabled, mb), True


def placement_notes(assignment: Mapping[str, str], knobs: Knobs, inv: ModelInventory) -> list[str]:
    return []


SPEC = DialectSpec(name="mainline", slot_rule="last_slots", tools=TABLES, render_policy=render_policy,
                   parse_policy=parse_policy, placement_notes=placement_notes)


# ---- tables per build ----------------------------------------------------------------------------------------
# Spellings of earlier builds (planner/builds.py FLAGS says which): bare -fa (flash attention off by default),
# llama-bench's -fa 0|1, and --no-mmap / -mmp 0|1 before -lm (builds up to 10587 still take them, deprecated).
_OLD_FLAGS: dict[str, tuple[Flag, ...]] = {
    "server": (
        Flag("fa", ("-fa", "--flash-attn"), "switch", const=True, env="LLAMA_ARG_FLASH_ATTN", env_kind="void",
             since=Spelling.FA_SWITCH),
        Flag("mmap", ("--no-mmap",), "switch", const=False, since=Spelling.NO_MMAP),
    ),
    "bench": (
        Flag("fa", ("-fa", "--flash-attn"), "choice", choices={"0": False, "1": True},
             render_as={True: "1", False: "0"}, sweep=True, since=Spelling.BENCH_FA_01),
        Flag("mmap", ("-mmp", "--mmap"), "choice", choices={"0": False, "1": True}, render_as={True: "1", False: "0"},
             sweep=True, since=Spelling.BENCH_MMP),
    ),
}
# What a build without the flag does (the setting's value when the flag is missing).
_ABSENT: dict[str, Any] = {"fit": False, "fitt": None, "fa": False, "op_offload": True, "no_host": False,
                           "swa_full": False, "mmap": True}


@lru_cache(maxsize=16)
def spec_for(build: Build) -> DialectSpec:
    """SPEC with the flags, defaults and -ngl rule of `build` (planner/builds.py FEATURES and FLAGS)."""
    if build.number is None:
        return SPEC
    tools = {}
    for tool, table in TABLES.items():
        group = "bench" if tool == "bench" else "server"
        fa_off = not build.accepts(Spelling.BENCH_FA_VALUE if tool == "bench" else Spelling.FA_VALUE)
        tools[tool] = for_build(table, build, _OLD_FLAGS[group], _ABSENT, {"fa": False} if fa_off else None)
    slot_rule = "last_slots" if build.has(Feature.NGL_OUTPUT_FIRST) else "last_blocks"
    return dataclasses.replace(SPEC, tools=tools, slot_rule=slot_rule)
