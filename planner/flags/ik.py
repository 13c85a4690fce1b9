"""ik_llama.cpp: flag tables for its server/cli (one common parser) and its llama-bench, and its op offload.

Source: ik_llama.cpp 8337e4cd (vendor/ik_llama.cpp-8337e4cd.tar.xz; docs/ik_llama.md): common/common.cpp
(gpt_params_find_arg), examples/llama-bench/llama-bench.cpp, src/llama.cpp, src/llama-load-tensors.cpp.
Behaviour that changed between builds is keyed by planner/builds.py features; `spec_for(build)` adapts the
tables. Unknown flags are warnings, not errors, since ik adds flags often.
- -ngl N: the last N blocks; the output layer only when N > n_layer (slot rule "last_blocks"). Since PR 2209
  (build 4761) no -ngl means 999 when a GPU exists, and -ngl 0 (or no GPU) drops every -ot and -ncmoe
  (llama_model_load_from_file).
- Server/cli: the -ot entries first, then -ncmoe/-cmoe (-cmoe = -ncmoe 999; the last value wins). One GPU: the
  LAST N MoE layers since PR 2262 (build 4797), the first N layer indices before. Several GPUs (split mode
  layer, N < n_layer, since PR 1464/1466): N is shared out by each GPU's share of the blocks and each GPU gives
  its last blocks (ncmoe_spread). llama-bench --n-cpu-moe N appends the first N layers' patterns at its place
  among the -ot options (add_cpu_buft_overrides).
- -op OP,0|1[,OP,0|1...] with OP a ggml_op enum value that moved between builds (OP_TABLES); -1 = all ops.
  Only the common parser has it (server, cli, sweep-bench); llama-bench has none.
- MUL_MAT_ID / MOE_FUSED_UP_GATE offload only when ubatch >= offload-batch-size * n_expert / n_expert_used
  (ggml-cuda.cu ggml_backend_cuda_offload_op); -cuda offload-batch-size=N changes the base (default 32).
"""
from __future__ import annotations

import dataclasses
import re
from functools import lru_cache
from typing import Any
from collections.abc import Mapping, Sequence

from ..builds import PINNED, Build, Feature, Spelling
from ..errors import FlagError
from ..model import ModelInventory
from ..plan import DEFAULT_MIN_BATCH, KV_TYPES, OP_CLASSES, Knobs, OffloadPolicy, OpRule
from .cmdline import DialectSpec, Event, Flag, MoeRule, ToolTable, for_build

# ggml_op enum values per ik build (ggml/include/ggml.h at each change, read from ik's history; ik logs
# "Setting offload policy for op NAME to ON|OFF" when it applies -op, which the CI test checks).
OP_TABLES: dict[str, dict[str, int]] = {
    "2025-05": {"MUL_MAT": 26, "MUL_MAT_ID": 27, "MOE_FUSED_UP_GATE": 29},                       # PR 405, build 3683
    "2025-08a": {"MUL_MAT": 27, "MUL_MAT_ID": 28, "MOE_FUSED_UP_GATE": 30},                      # PR 689, build 3838
    "2025-08": {"MUL_MAT": 27, "MUL_MAT_ID": 28, "FUSED_UP_GATE": 30, "MOE_FUSED_UP_GATE": 31},  # PR 741, build 3869
}
# Our op classes -> the ggml ops they cover (the output matmul is a MUL_MAT like any dense one).
CLASS_OPS: dict[str, tuple[str, ...]] = {
    "dense_matmul": ("MUL_MAT", "FUSED_UP_GATE"), "moe_matmul": ("MUL_MAT_ID",),
    "moe_fused_up_gate": ("MOE_FUSED_UP_GATE",), "output": ("MUL_MAT",),
}
CUDA_MIN_BATCH_KEY = "offload-batch-size"

_FA = {"auto": True, "1": True, "on": True, "off": False, "0": False}   # case-insensitive
_B01 = {"0": False, "1": True}
_B01_INV = {"0": True, "1": False}
_SM = ("none", "layer", "attn", "graph")

_SERVER_FLAGS: tuple[Flag, ...] = (
    Flag("model", ("-m", "--model"), env="LLAMA_ARG_MODEL"),
    Flag("ngl", ("-ngl", "--gpu-layers", "--n-gpu-layers"), "int", env="LLAMA_ARG_N_GPU_LAYERS"),
    Flag("ts", ("-ts", "--tensor-split")),
    Flag("sm", ("-sm", "--split-mode"), "choice", choices={m: m for m in _SM}, render_as={m: m for m in _SM}),
    Flag("mg", ("-mg", "--main-gpu"), "int"),
    Flag("dev", ("-dev", "--device")),
    Flag("ot", ("-ot", "--override-tensor"), since=Spelling.OVERRIDE_TENSOR),
    Flag("cmoe", ("-cmoe", "--cpu-moe"), "switch", since=Spelling.CPU_MOE),
    Flag("ncmoe", ("-ncmoe", "--n-cpu-moe"), "int", since=Spelling.N_CPU_MOE),
    Flag("fit", ("--fit",), "switch", since=Spelling.IK_FIT),
    Flag("ctx", ("-c", "--ctx-size"), "int", env="LLAMA_ARG_CTX_SIZE"),
    Flag("np", ("-np", "--parallel"), "int", env="LLAMA_ARG_N_PARALLEL"),
    Flag("batch", ("-b", "--batch-size"), "int", env="LLAMA_ARG_BATCH"),
    Flag("ubatch", ("-ub", "--ubatch-size"), "int", env="LLAMA_ARG_UBATCH"),
    Flag("fa", ("-fa", "--flash-attn"), "choice", choices=_FA, render_as={True: "on", False: "off"}, icase=True,
         since=Spelling.FA_VALUE),
    Flag("fa", ("-no-fa", "--no-flash-attn"), "switch", const=False, since=Spelling.NO_FA),
    Flag("ctk", ("-ctk", "--cache-type-k"), env="LLAMA_ARG_CACHE_TYPE_K"),
    Flag("ctv", ("-ctv", "--cache-type-v"), env="LLAMA_ARG_CACHE_TYPE_V"),
    Flag("threads", ("-t", "--threads"), "int", env="LLAMA_ARG_THREADS"),
    Flag("kv_offload", ("-nkvo", "--no-kv-offload"), "switch", const=False),
    Flag("mmap", ("--no-mmap",), "switch", const=False),
    Flag("mla", ("-mla", "--mla-use"), "int", since=Spelling.MLA),
    Flag("amb", ("-amb", "--attention-max-batch"), "int", since=Spelling.AMB),
    Flag("fmoe", ("-no-fmoe", "--no-fused-moe"), "switch", const=False, since=Spelling.NO_FMOE),
    Flag("rtr", ("-rtr", "--run-time-repack"), "switch", const=True, since=Spelling.RTR),
    Flag("op", ("-op", "--offload-policy"), since=Spelling.OFFLOAD_POLICY),
    Flag("ooae", ("-no-ooae", "--no-offload-only-active-experts"), "switch", const=False, since=Spelling.NO_OOAE),
    Flag("cuda", ("-cuda", "--cuda-params"), since=Spelling.CUDA_PARAMS),
    Flag("cache_ram", ("--cache-ram", "-cram"), "int", since=Spelling.CACHE_RAM),   # the server's prompt cache, MiB
)

# Other ik server/cli options (gpt_params_find_arg) -> number of values.
_SERVER_KNOWN: dict[str, int] = {
    **{s: 0 for s in (
        "-e", "--escape", "--no-escape", "--prompt-cache-all", "--prompt-cache-ro", "--adaptive-updt-w-cur",
        "--spec-autotune", "--lora-init-without-apply", "--no-mmproj-offload", "-i", "--interactive", "-sp",
        "--special", "--embedding", "--embeddings", "-if", "--interactive-first", "-cnv", "--conversation",
        "--infill", "-dkvc", "--dump-kv-cache", "-mli", "--multiline-input", "--simple-io", "-cb",
        "--cont-batching", "-nocb", "--no-cont-batching", "-ger", "--grouped-expert-routing", "-no-fug",
        "--no-fused-up-gate", "-no-mmad", "--no-fused-mul-multiadd", "-rcache", "--rope-cache", "-gr",
        "--graph-reuse", "-no-gr", "--no-graph-reuse", "-co", "--color", "--mlock", "--defer-experts", "-thp",
        "--transparent-huge-pages", "-vq", "--validate-quants", "-mqkv", "--merge-qkv", "-muge",
        "--merge-up-gate-experts", "-khad", "--k-cache-hadamard", "-vhad", "--v-cache-hadamard", "-smgs",
        "--split-mode-graph-scheduling", "-sas", "--scheduler-async", "-smf16", "--split-mode-f16", "-smf32",
        "--split-mode-f32", "-v", "--verbose", "--verbose-prompt", "--no-display-prompt", "--check-tensors",
        "--hellaswag", "--winogrande", "--multiple-choice", "--kl-divergence", "--ignore-eos", "--penalize-nl",
        "-h", "--help", "--usage", "--version", "--dry-run", "-dr", "--in-prefix-bos", "--spm-infill",
        "--send-done", "--webui-mcp-proxy", "--ui-mcp-proxy", "--no-slots", "--metrics", "--jinja", "--peg",
        "--parallel-tool-calls", "-pps", "--no-context-shift", "--process-output", "--no-ppl", "--no-warmup",
        "--warmup-batch", "-wb", "--minilog", "--perplexity", "--all-logits", "--log-disable", "--log-enable",
        "--log-new", "--log-append")},
    **{s: 1 for s in (
        "-s", "--seed", "-tb", "--threads-batch", "-tm", "--threads-mtmd", "-td", "--threads-draft", "-tbd",
        "--threads-batch-draft", "-p", "--prompt", "--prompt-cache", "-bf", "--binary-file", "-f", "--file",
        "--in-file", "-n", "--predict", "--n-predict", "--top-k", "-cd", "--ctx-size-draft", "--grp-attn-n",
        "-gan", "--grp-attn-w", "-gaw", "--rope-freq-base", "--rope-freq-scale", "--rope-scaling", "--rope-scale",
        "--yarn-orig-ctx", "--yarn-ext-factor", "--yarn-attn-factor", "--yarn-beta-fast", "--yarn-beta-slow",
        "--pooling", "--attention", "--defrag-thold", "-dt", "--max-extra-alloc", "-mea", "-nrep",
        "--n-repetitions", "--samplers", "--sampling-seq", "--top-p", "--min-p", "--temp", "--tfs", "--typical",
        "--repeat-last-n", "--repeat-penalty", "--frequency-penalty", "--presence-penalty", "--dynatemp-range",
        "--dynatemp-exp", "--mirostat", "--mirostat-lr", "--mirostat-ent", "--xtc-probability",
        "--xtc-threshold", "--top-n-sigma", "--dry-multiplier", "--dry-base", "--dry-allowed-length",
        "--dry-penalty-last-n", "--dry-sequence-breaker", "--adaptive-target", "--adaptive-decay",
        "--cfg-negative-prompt", "--cfg-negative-prompt-file", "--cfg-scale", "--keep", "--recurrent-ckpt-mode",
        "--chunks", "-ns", "--sequences", "--p-split", "-ps", "-md", "--model-draft", "--spec-type", "-a",
        "--alias", "-mu", "--model-url", "-hft", "--hf-token", "-hfr", "--hf-repo", "-hff", "--hf-file",
        "--lora", "--control-vector", "--mmproj", "--mmproj-url", "--mtmd-kq-type", "--image", "--audio",
        "--image-min-tokens", "--image-max-tokens", "--embd-normalize", "--embd-output-format",
        "--embd-separator", "-ctk-first", "--cache-type-k-first", "-ctk-last", "--cache-type-k-last",
        "-ctv-first", "--cache-type-v-first", "-ctv-last", "--cache-type-v-last",
        "--mtp-requantize-output-tensor", "-mtprot", "-ctkd", "--cache-type-k-draft", "-ctvd",
        "--cache-type-v-draft", "-ser", "--smart-expert-reduction", "-ngld", "--gpu-layers-draft",
        "--n-gpu-layers-draft", "--max-gpu", "--rpc", "--override-kv", "--gpu-fit-margin", "-gfm", "-draft",
        "--draft-params", "--fit-margin", "-wgt", "--worst-graph-tokens", "-fdn", "--fused-delta-net", "-grt",
        "--graph-reduce-type", "-gap", "--graph-attn-precision", "--numa", "-devd", "--device-draft",
        "--verbosity", "-r", "--reverse-prompt", "--banned-string-file", "--banned-n",
        "--allowlist-unicode-rule", "--allowlist-pieces", "--allowlist-keyword", "--allowlist-keyword-delay",
        "--expiring-logit-bias-file", "-ld", "--logdir", "-lcs", "--lookup-cache-static", "-lcd",
        "--lookup-cache-dynamic", "--save-all-logits", "--kl-divergence-base", "--ppl-stride",
        "--ppl-output-type", "-ptc", "--print-token-count", "--hellaswag-tasks", "--winogrande-tasks",
        "--multiple-choice-tasks", "-l", "--logit-bias", "--in-prefix", "--in-suffix", "--grammar",
        "--grammar-file", "-j", "--json-schema", "--host", "--port", "--path", "--webui", "--api-key",
        "--api-key-file", "--ssl-key-file", "--ssl-cert-file", "--timeout", "-to", "--threads-http", "-spf",
        "--system-prompt-file", "--log-format", "--slot-save-path", "--reasoning-tokens", "--reasoning-budget",
        "--sql-save-file", "--sqlite-zstd-ext-file", "--chat-template", "--chat-template-file",
        "--chat-template-kwargs", "--reasoning-format", "-rea", "--reasoning", "--reasoning-budget-message",
        "--skip-chat-parsing", "--no-prefill-assistant", "--slot-prompt-similarity", "-sps", "-npp", "-ntg",
        "-npl", "--context-file", "--chunk-size", "--chunk-separator", "--junk", "--context-shift",
        "--ctx-checkpoints", "--ctx-checkpoints-interval", "--ctx-checkpoints-tolerance", "-cram", "--cache-ram",
        "-crs", "--cache-ram-similarity", "-cram-n-min", "--cache-ram-n-min", "--pos", "-o", "--output",
        "--output-file", "--output-draft", "--draft-output", "--draft-output-file", "-ofreq",
        "--output-frequency", "--save-frequency", "--output-tensor-name", "--chunk", "--from-chunk",
        "--positive-file", "--negative-file", "--pca-batch", "--pca-iter", "--method", "--output-format",
        "--log-file")},
    **{s: 2 for s in ("--spec-replace", "--lora-scaled", "--control-vector-scaled", "--control-vector-layer-range")},
}

_BENCH_FLAGS: tuple[Flag, ...] = (
    Flag("model", ("-m", "--model"), sweep=True),
    Flag("n_prompt", ("-p", "--n-prompt"), "int", sweep=True),
    Flag("n_gen", ("-n", "--n-gen"), "int", sweep=True),
    Flag("batch", ("-b", "--batch-size"), "int", sweep=True),
    Flag("ubatch", ("-ub", "--ubatch-size"), "int", sweep=True),
    Flag("ctk", ("-ctk", "--cache-type-k"), sweep=True),
    Flag("ctv", ("-ctv", "--cache-type-v"), sweep=True),
    Flag("threads", ("-t", "--threads"), "int", sweep=True),
    Flag("ngl", ("-ngl", "--n-gpu-layers"), "int", sweep=True),
    Flag("sm", ("-sm", "--split-mode"), "choice", choices={m: m for m in ("none", "layer", "graph")},
         render_as={m: m for m in ("none", "layer", "graph")}, sweep=True),
    Flag("mg", ("-mg", "--main-gpu"), "int", sweep=True),
    Flag("kv_offload", ("-nkvo", "--no-kv-offload"), "choice", choices=_B01_INV, render_as={True: "0", False: "1"},
         sweep=True),
    Flag("fa", ("-fa", "--flash-attn"), "choice", choices=_B01, render_as={True: "1", False: "0"}, sweep=True),
    Flag("mla", ("-mla", "--mla-attn"), "int", sweep=True, since=Spelling.MLA),
    Flag("amb", ("-amb", "--attn-max-batch"), "int", sweep=True, since=Spelling.AMB),
    Flag("mmap", ("-mmp", "--mmap"), "choice", choices=_B01, render_as={True: "1", False: "0"}, sweep=True),
    Flag("ts", ("-ts", "--tensor-split")),
    Flag("reps", ("-r", "--repetitions"), "int"),
    Flag("rtr", ("-rtr", "--run-time-repack"), "choice",
         choices={"1": True, "on": True, "auto": True, "0": False, "off": False}, render_as={True: "1", False: "0"},
         icase=True, since=Spelling.RTR),
    Flag("cuda", ("-cuda", "--cuda-params"), since=Spelling.CUDA_PARAMS),
    Flag("fmoe", ("-fmoe", "--fused-moe"), "choice", choices=_B01, render_as={True: "1", False: "0"},
         since=Spelling.BENCH_FMOE),
    Flag("ooae", ("-no-ooae", "--no-offload-only-active-experts"), "choice", choices=_B01_INV,
         render_as={True: "0", False: "1"}, since=Spelling.NO_OOAE),
    Flag("ot", ("-ot", "--override-tensor"), since=Spelling.BENCH_OVERRIDE_TENSOR),
    Flag("ncmoe", ("--n-cpu-moe",), "int", since=Spelling.BENCH_N_CPU_MOE),
    Flag("fit", ("--fit",), "choice", choices=_B01, render_as={True: "1", False: "0"}),
)
_BENCH_KNOWN: dict[str, int] = {
    **{s: 0 for s in ("-h", "--help", "-v", "--verbose", "--defer-experts")},
    **{s: 1 for s in ("-pg", "-gp", "-tgb", "--threads-gen-batch", "-rpc", "--rpc", "--numa", "-gr",
                      "--graph-reuse", "-ser", "--smart-expert-reduction", "-embd", "--embeddings", "-o",
                      "--output", "-oe", "--output-err", "-w", "--warmup", "-mqkv", "--merge-qkv", "-muge",
                      "--merge-up-gate-exps", "-sas", "--scheduler-async", "--fit-margin", "--max-gpu", "-rcache",
                      "--rope-cache", "-thp", "--transparent-huge-pages", "-ger", "--grouped-expert-routing",
                      "-no-fug", "--no-fused-up-gate", "--print-overrides")},
}

# The server's -ncmoe regex per layer (ik common.cpp); llama-bench's (ik llama-bench.cpp add_cpu_buft_overrides).
_SERVER_MOE = MoeRule(ncmoe_template="blk\\.{i}\\.(ffn_(up|down|gate|gate_up)_exps\\.weight)", cmoe_pattern=None,
                      order="last_moe_layers", placement="after_user", accumulate=False)
# llama-bench: --n-cpu-moe appends its patterns where it stands among the -ot options (add_cpu_buft_overrides).
_BENCH_MOE = MoeRule(ncmoe_template="blk\\.{i}\\.(ffn_(up|down|gate)_exps\\.weight)", cmoe_pattern=None,
                     order="first_layers", placement="cmdline", accumulate=True)

_SERVER_DEFAULTS: dict[str, Any] = {
    "ngl": 999, "ctx": None, "np": 1, "batch": 2048, "ubatch": 512, "fa": True, "ctk": "f16", "ctv": "f16",
    "threads": 0, "kv_offload": True, "mmap": True, "mla": 3, "amb": 256, "fmoe": True, "rtr": False, "ooae": True,
}
_BENCH_DEFAULTS: dict[str, Any] = {
    "ngl": 999, "batch": 2048, "ubatch": 512, "fa": True, "ctk": "f16", "ctv": "f16", "threads": 0,
    "kv_offload": True, "mmap": True, "mla": 3, "amb": 0, "fmoe": True, "rtr": False, "ooae": True,
    "n_prompt": 512, "n_gen": 128, "reps": 5,
}


def _table(tool: str) -> ToolTable:
    if tool == "bench":
        return ToolTable(
            dialect="ik", tool="bench", binary="llama-bench", flags=_BENCH_FLAGS, known=_BENCH_KNOWN, strict=False,
            ot_sep=",", ts_sep="/", ts_split=r"[;/]+", int_ranges=False, defaults=_BENCH_DEFAULTS,
            always=frozenset({"ngl", "batch", "ubatch", "fa", "mla", "amb"}),
            ignored_knobs=frozenset({"n_ctx", "n_seq", "swa_full"}),
            kv_types=tuple(t for t in KV_TYPES if t != "f32"), moe=_BENCH_MOE)
    return ToolTable(
        dialect="ik", tool=tool, binary=f"llama-{tool}", flags=_SERVER_FLAGS, known=_SERVER_KNOWN, strict=False,
        ot_sep=",", ts_sep=",", ts_split=r"[,/]+", int_ranges=False, defaults=_SERVER_DEFAULTS,
        always=frozenset({"ngl", "ctx", "np", "batch", "ubatch", "fa", "mla", "amb"}), ignored_knobs=frozenset(),
        kv_types=KV_TYPES, moe=_SERVER_MOE)


TABLES: dict[str, ToolTable] = {tool: _table(tool) for tool in ("server", "cli", "bench")}


def op_table_name(build: Build) -> str:
    if build.has(Feature.OP_IDS_741):
        return "2025-08"
    return "2025-08a" if build.has(Feature.OP_IDS_689) else "2025-05"


def op_table(opts: Mapping[str, Any]) -> dict[str, int]:
    """The op ids of the target build (opts["ik_op_table"] names a table outright)."""
    name = opts.get("ik_op_table") or op_table_name(opts.get("build") or PINNED["ik"])
    if name not in OP_TABLES:
        raise FlagError(f"unknown ik op table {name!r}; known: {', '.join(OP_TABLES)}")
    return OP_TABLES[name]


def moe_offload_threshold(min_batch: int, n_expert: int, n_expert_used: int) -> int:
    """ubatch from which ik offloads MUL_MAT_ID / MOE_FUSED_UP_GATE: min_batch * n_expert / n_expert_used."""
    if n_expert <= 0 or n_expert_used <= 0:
        return min_batch
    return min_batch * n_expert // n_expert_used


def render_policy(knobs: Knobs, table: ToolTable, inv: ModelInventory, opts: Mapping[str, Any]
                  ) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    pol = knobs.offload
    ids = op_table(opts)
    rules = {op: pol.rule(op) for op in OP_CLASSES}
    if rules["output"].enabled != rules["dense_matmul"].enabled:
        raise FlagError("ik cannot offload the output matmul differently from dense matmuls (both are MUL_MAT): "
                        "knob offload.output.enabled must equal offload.dense_matmul.enabled")
    batches = {r.min_batch for r in rules.values()}
    if len(batches) > 1:
        raise FlagError(f"ik has one offload base batch (-cuda {CUDA_MIN_BATCH_KEY}=N) for every op class; knob "
                        f"offload.*.min_batch = {sorted(batches)} must be equal (ik scales it for MoE ops itself)")
    settings: list[tuple[str, Any]] = []
    off = sorted({ids[o] for op, r in rules.items() if not r.enabled for o in CLASS_OPS[op] if o in ids})
    if off:
        if "op" not in table.keys():  # noqa: SIM118 (a ToolTable, not a dict)
            raise FlagError(f"ik {table.binary} has no -op (turning off the offload of "
                            f"{', '.join(op for op, r in rules.items() if not r.enabled)}): use llama-sweep-bench or "
                            "the server" if table.tool == "bench" else
                            "this ik build has no -op (added by ik PR 405, build 3683)")
        settings.append(("op", ",".join(f"{i},0" for i in off)))
    mb = batches.pop()
    if mb != DEFAULT_MIN_BATCH:
        settings.append(("cuda", f"{CUDA_MIN_BATCH_KEY}={mb}"))
    ooae_default = table.defaults.get("ooae")
    if knobs.only_active_experts != ooae_default:
        if "ooae" not in table.keys():  # noqa: SIM118 (a ToolTable, not a dict)
            verb = "enable" if knobs.only_active_experts else "disable"
            raise FlagError(f"ik {table.binary} of this build cannot {verb}"
                            " uploading only the active experts (-ooae came with ik PR 698, -no-ooae and llama-bench's "
                            "switch with PR 842)")
        settings.append(("ooae", knobs.only_active_experts))
    return settings, {}


def _pairs(text: str, spelling: str) -> list[tuple[int, int]]:
    parts = text.split(",")
    try:
        nums = [int(p) for p in parts]
    except ValueError as e:
        raise FlagError(f"{spelling} {text!r}: expected OP,0|1[,OP,0|1...] with integer op ids") from e
    if len(nums) < 2:
        raise FlagError(f"{spelling} {text!r}: expected OP,0|1 pairs")
    return [(nums[i], nums[i + 1]) for i in range(0, len(nums) - 1, 2)]


def parse_policy(settings: Mapping[str, Any], events: Sequence[Event], env: Mapping[str, str], table: ToolTable,
                 warnings: list[str], opts: Mapping[str, Any]) -> tuple[OffloadPolicy, bool]:
    ids = op_table(opts)
    name_of = {v: k for k, v in ids.items()}
    enabled = {name: True for name in ids}
    for e in events:
        if e.key != "op":
            continue
        for op_id, val in _pairs(e.value, e.spelling):
            if op_id == -1:
                enabled = {name: bool(val) for name in enabled}
            elif op_id in name_of:
                enabled[name_of[op_id]] = bool(val)
            else:
                known = ", ".join(f"{k}={v}" for k, v in ids.items())
                warnings.append(f"W018 {e.spelling}: op id {op_id} is not one of the ops we model in ik table "
                                f"{opts.get('ik_op_table') or op_table_name(opts.get('build') or PINNED['ik'])} "
                                f"({known})")
    if "FUSED_UP_GATE" in enabled and enabled["FUSED_UP_GATE"] != enabled["MUL_MAT"]:
        warnings.append("W022 -op sets MUL_MAT and FUSED_UP_GATE differently; dense_matmul follows MUL_MAT")
    mb = DEFAULT_MIN_BATCH
    if "cuda" in settings:
        for item in re.split(r"[,;]", str(settings["cuda"])):
            key, _, val = item.partition("=")
            if key.strip() == CUDA_MIN_BATCH_KEY:
                try:
                    mb = int(val)
                except ValueError as e:
                    raise FlagError(f"-cuda {settings['cuda']!r}: {CUDA_MIN_BATCH_KEY} must be an integer") from e
    policy = OffloadPolicy(**{op: OpRule(enabled[CLASS_OPS[op][0]], mb) for op in OP_CLASSES})
    return policy, bool(settings.get("ooae", table.defaults.get("ooae", True)))


def placement_notes(assignment: Mapping[str, str], knobs: Knobs, inv: ModelInventory) -> list[str]:
    """ik offloads MoE ops only from ubatch >= min_batch * n_expert / n_expert_used (docs/llamacpp.md section 4)."""
    hp = inv.hparams
    rule = knobs.offload.moe_matmul
    if not hp.is_moe or not rule.enabled:
        return []
    if not any(t.is_expert and assignment.get(t.name) == "CPU" for t in inv.allocated()):
        return []
    need = moe_offload_threshold(rule.min_batch, hp.n_expert, hp.n_expert_used)
    if knobs.n_ubatch_eff >= need:
        return []
    return [f"W026 ik offloads MoE matmuls on CPU-resident experts only from ubatch {need} "
            f"(= {rule.min_batch} * {hp.n_expert} / {hp.n_expert_used}); at ubatch {knobs.n_ubatch_eff} they run "
            "on the CPU during prompt processing"]


# ---- tables per build ----------------------------------------------------------------------------------------
# Server/cli spellings of earlier builds (planner/builds.py FLAGS says which): before PR 863 flash attention and
# fused MoE were off by default and bare -fa / -fmoe turned them on; between PR 698 and PR 842 -ooae turned on
# uploading only the active experts (llama-bench had no switch).
_OLD_SERVER_FLAGS: tuple[Flag, ...] = (
    Flag("fa", ("-fa", "--flash-attn"), "switch", const=True, since=Spelling.FA_SWITCH),
    Flag("fmoe", ("-fmoe", "--fused-moe"), "switch", const=True, since=Spelling.FMOE),
    Flag("ooae", ("-ooae", "--offload-only-active-experts"), "switch", const=True, since=Spelling.OOAE),
)
# What a build without the flag does (the setting's value when the flag is missing).
_ABSENT: dict[str, Any] = {"fa": False, "fmoe": False, "ooae": False, "mla": 0, "amb": 0, "rtr": False}


@lru_cache(maxsize=16)
def spec_for(build: Build) -> DialectSpec:
    """SPEC with the flags, defaults and -ncmoe rule of `build` (planner/builds.py FEATURES and FLAGS)."""
    tools: dict[str, ToolTable] = {}
    for tool, table in TABLES.items():
        bench = tool == "bench"
        defaults: dict[str, Any] = {}
        if not build.accepts(Spelling.NO_FA):        # before PR 863: off by default (llama-bench too)
            defaults.update(fa=False, fmoe=False)
        if not build.has(Feature.OOAE_DEFAULT_ON):
            defaults["ooae"] = False
        if not bench and not build.has(Feature.NGL_AUTO):
            defaults["ngl"] = 0
        table = for_build(table, build, () if bench else _OLD_SERVER_FLAGS, _ABSENT, defaults)
        if not bench and table.moe is not None and not build.has(Feature.NCMOE_LAST_LAYERS):
            table = dataclasses.replace(table, moe=dataclasses.replace(table.moe, order="first_layers"))
        tools[tool] = table
    return dataclasses.replace(SPEC, tools=tools)


SPEC = DialectSpec(name="ik", slot_rule="last_blocks", tools=TABLES, render_policy=render_policy,
                   parse_policy=parse_policy, placement_notes=placement_notes)
