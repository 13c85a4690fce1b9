"""One validation step between reading a model and using it: the file's inventory against what llama.cpp's loader
creates for its architecture, so that nothing downstream (memory, graph, cost, flags) sees a model llama.cpp
would refuse or that we could not build.

Facts and their sources (llama.cpp vendored in llama-cpp-python 0.3.36):
- src/llama-model-loader.cpp create_tensor: a required tensor that is missing is "missing tensor 'X'"; a shape
  that differs from the one the hyper-parameters give is "tensor 'X' has wrong shape"; done_getting_tensors:
  every tensor in the file must be created by the architecture ("wrong number of tensors; expected N, got M"),
  so an unknown, renamed or extra-layer tensor is refused too.
- src/llama-model.cpp create_tensor_qkv (the architectures in QKV_ARCHS): either a fused attn_qkv.weight
  [n_embd, q+k+v] (with an optional attn_qkv.bias) or separate attn_q/k/v.weight; Q/K/V biases are optional.
  create_tensor_gate_up_exps (GATE_UP_ARCHS): a fused ffn_gate_up_exps.weight [n_embd, 2*n_ff_exp, n_expert]
  or separate gate and up experts.
- src/llama-model.cpp load_hparams and src/models/<arch>.cpp load_arch_hparams: the keys read with
  required=true (REQUIRED_KEYS), GGML_ASSERTs on the expert counts, and the per-arch graph asserts on head sizes
  (HEAD_DIM_RULES), which abort llama.cpp at the first decode.
- src/llama-vocab.cpp load: tokenizer.ggml.model is required and must name a tokenizer it knows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Mapping

from .archs import ArchSpec, tensor_shapes
from .errors import GGUFError, InputError
from .ggml_types import BY_NAME
from .model import ModelInventory

if TYPE_CHECKING:
    from .plan import Plan

# Keys llama.cpp reads with required=true, per architecture (the general ones for every architecture).
REQUIRED_KEYS_ALL = ("context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon")
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "gpt-oss": ("expert_feed_forward_length", "attention.sliding_window"),         # openai-moe.cpp
    "deepseek2": ("attention.kv_lora_rank", "expert_feed_forward_length", "expert_shared_count"),
    "glm4moe": ("expert_feed_forward_length", "expert_shared_count"),
    "llama4": ("expert_feed_forward_length", "interleave_moe_layer_step"),
}
# llama-vocab.cpp: the tokenizer models it loads (anything else: "unknown tokenizer").
TOKENIZER_MODELS = frozenset({"no_vocab", "none", "llama", "bert", "gpt2", "hybriddna", "whitespace", "t5", "rwkv",
                              "test", "plamo2", "gemma4", "ugm"})
# Architectures that read attention weights through create_tensor_qkv, experts through create_tensor_gate_up_exps.
QKV_ARCHS = frozenset({"llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "llama4", "glm4moe", "gpt-oss"})
GATE_UP_ARCHS = frozenset({"deepseek2"})
MTP_PROBE_ARCHS = frozenset({"deepseek2", "glm4moe"})   # loaders that make NextN blocks optional in trunk-only files
# Graph asserts: n_embd_head_v == n_embd_head_k (and == n_rot where listed); src/models/<arch>.cpp graph ctor.
HEAD_DIM_RULES: dict[str, bool] = {"llama": True, "qwen2": True, "qwen3": True, "qwen3moe": True, "qwen2moe": True,
                                   "llama4": True, "glm4moe": False, "gpt-oss": True}
# (gpt-oss: openai-moe.cpp sizes Q/K/V by n_head * n_rot, so the rope dimension must be the head size.)
# Architectures whose loader creates output.weight as required (no tied-embedding fallback): qwen2moe.cpp,
# openai-moe.cpp (flags 0 where the others pass TENSOR_NOT_REQUIRED).
OUTPUT_REQUIRED = frozenset({"qwen2moe", "gpt-oss"})
MOE_ARCHS = frozenset({"qwen3moe", "qwen2moe", "deepseek2", "gpt-oss", "glm4moe", "llama4"})
LLAMA_MAX_EXPERTS = 1024                     # llama-hparams.h
MAINLINE_TYPES = frozenset(t.name for t in BY_NAME.values() if t.id < 43)   # ggml.h GGML_TYPE_COUNT = 43


def _ne4(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape as ggml holds it: four dimensions, missing ones 1 (llama.cpp compares all four)."""
    return tuple(shape) + (1,) * (4 - len(shape))


def check_metadata(meta: Mapping[str, Any], arch: str, source: str) -> None:
    """Required keys and the tokenizer, before hparams are read (a missing key is named, not defaulted)."""
    for key in REQUIRED_KEYS_ALL + REQUIRED_KEYS.get(arch, ()):
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{source}: GGUF metadata lacks {arch}.{key}, which llama.cpp requires for {arch}")
    tok = meta.get("tokenizer.ggml.model")
    if tok is None:
        raise GGUFError(f"{source}: GGUF metadata lacks tokenizer.ggml.model, which llama.cpp requires")
    if not isinstance(tok, str) or tok not in TOKENIZER_MODELS:
        raise GGUFError(f"{source}: tokenizer.ggml.model is {str(tok)[:40]!r}, which llama.cpp does not know "
                        f"(it loads {', '.join(sorted(TOKENIZER_MODELS))})")


def expected_shapes(spec: ArchSpec, names: set[str]) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) tensor name -> shape for a file holding `names`, with the fused variants the
    architecture's loader takes where the file has them."""
    hp = spec.hparams
    tied = "output.weight" not in names and hp.arch not in OUTPUT_REQUIRED
    required = dict(tensor_shapes(spec, tied_output=tied))
    optional: dict[str, tuple[int, ...]] = {}
    if tied:
        optional["output.weight"] = (hp.n_embd, hp.n_vocab)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        if hp.arch in QKV_ARCHS and p + "attn_q.weight" in required:
            q, k, v = (required[p + f"attn_{x}.weight"][1] for x in "qkv")
            for x, n in zip("qkv", (q, k, v)):
                required.pop(p + f"attn_{x}.bias", None)
                optional[p + f"attn_{x}.bias"] = (n,)
            if p + "attn_qkv.weight" in names:
                for x in "qkv":
                    del required[p + f"attn_{x}.weight"]
                required[p + "attn_qkv.weight"] = (hp.n_embd, q + k + v)
                optional[p + "attn_qkv.bias"] = (q + k + v,)
            if il >= hp.n_layer - hp.n_nextn:     # create_tensor_qkv with TENSOR_SKIP: every variant optional
                for x in ("q", "k", "v", "qkv"):
                    if p + f"attn_{x}.weight" in required:
                        optional[p + f"attn_{x}.weight"] = required.pop(p + f"attn_{x}.weight")
                optional.setdefault(p + "attn_qkv.weight", (hp.n_embd, q + k + v))
                optional.setdefault(p + "attn_qkv.bias", (q + k + v,))
        if hp.arch in GATE_UP_ARCHS and p + "ffn_gate_up_exps.weight" in names and p + "ffn_up_exps.weight" in required:
            e, f, x = required.pop(p + "ffn_up_exps.weight")
            del required[p + "ffn_gate_exps.weight"]
            required[p + "ffn_gate_up_exps.weight"] = (e, 2 * f, x)
    n_main = hp.n_layer - hp.n_nextn
    if hp.n_nextn and hp.arch in MTP_PROBE_ARCHS and f"blk.{n_main}.nextn.eh_proj.weight" not in names:
        # a trunk-only file: without the first NextN block's eh_proj every tensor of the NextN blocks is
        # TENSOR_NOT_REQUIRED (glm4-moe.cpp / deepseek2.cpp: mtp_probe, trunk_only, mtp_flags)
        for name in [n for n in required if n.startswith("blk.") and int(n.split(".")[1]) >= n_main]:
            optional[name] = required.pop(name)
    if hp.arch == "deepseek2":
        for name in [n for n in required if n.endswith("exp_probs_b.bias")]:
            optional[name] = required.pop(name)     # deepseek2.cpp: TENSOR_NOT_REQUIRED (glm4-moe.cpp: required)
    return required, optional


def check_hparams(spec: ArchSpec, source: str) -> None:
    """Counts consistent with each other, as llama.cpp's load_hparams asserts them."""
    hp = spec.hparams
    if hp.arch in MOE_ARCHS and hp.n_expert == 0:
        raise GGUFError(f"{source}: {hp.arch}.expert_count is missing or 0; llama.cpp needs experts for {hp.arch}")
    if hp.n_expert > LLAMA_MAX_EXPERTS:
        raise GGUFError(f"{source}: {hp.arch}.expert_count {hp.n_expert} is above llama.cpp's {LLAMA_MAX_EXPERTS}")
    if hp.n_expert and not 0 < hp.n_expert_used <= hp.n_expert:
        raise GGUFError(f"{source}: {hp.arch}.expert_used_count is {hp.n_expert_used}; llama.cpp needs 1 to "
                        f"expert_count ({hp.n_expert})")
    if not hp.n_expert and hp.n_expert_used:
        raise GGUFError(f"{source}: {hp.arch}.expert_used_count {hp.n_expert_used} without experts")
    rule = HEAD_DIM_RULES.get(hp.arch)
    if rule is not None:
        if hp.head_dim_v != hp.head_dim_k:
            raise GGUFError(f"{source}: head sizes differ (key {hp.head_dim_k}, value {hp.head_dim_v}); llama.cpp's "
                            f"{hp.arch} graph asserts they are equal")
        if rule and hp.n_rot != hp.head_dim_k:
            raise GGUFError(f"{source}: rope.dimension_count {hp.n_rot} differs from the head size {hp.head_dim_k}; "
                            f"llama.cpp's {hp.arch} graph asserts they are equal")
    for il, hkv in enumerate(hp.n_head_kv):
        if not hkv or hkv > hp.n_head or hp.n_head % hkv:
            raise GGUFError(f"{source}: layer {il} has {hkv} KV heads for {hp.n_head} heads; llama.cpp needs a "
                            "divisor of the head count (grouped-query attention)")
    if hp.n_rot < 1 or hp.n_rot % 2:
        raise GGUFError(f"{source}: rope.dimension_count is {hp.n_rot}; llama.cpp's ROPE needs an even number of at "
                        "least 2 (it asserts or hangs at the first decode)")
    if hp.is_mla and any(h != 1 for h in hp.n_head_kv):
        raise GGUFError(f"{source}: MLA with {max(hp.n_head_kv)} KV heads; llama.cpp's MLA cache has one (the "
                        "converter writes attention.head_count_kv = 1) and its graph asserts on any other")
    if hp.is_mla and hp.head_dim_k != hp.mla_kv_lora_rank + hp.n_rot:
        raise GGUFError(f"{source}: MLA key size {hp.head_dim_k} is not kv_lora_rank {hp.mla_kv_lora_rank} + rope "
                        f"{hp.n_rot}; llama.cpp's graph asserts it is")
    if not hp.is_mla and hp.n_rot > hp.head_dim_k:
        raise GGUFError(f"{source}: rope.dimension_count {hp.n_rot} is more than the head size {hp.head_dim_k}; "
                        "llama.cpp's ROPE asserts n_dims <= ne0 at the first decode")
    if hp.is_mla and spec.head_dim_k_mla - hp.n_rot < 1:
        raise GGUFError(f"{source}: key_length_mla {spec.head_dim_k_mla} leaves no room beside the rope dimension "
                        f"{hp.n_rot}; llama.cpp asserts n_embd_head_qk_nope >= 1")


def _f32_only(name: str) -> bool:
    """Tensors llama.cpp uses as operands of element-wise ops (RMS-norm weights, biases, attention sinks): the CPU
    backend's MUL / ADD / ADD_ID take them only as F32 and abort at the first decode otherwise (observed with the
    CPU llama-bench for F16 and BF16); converters and llama-quantize always write them F32."""
    return name.endswith((".bias", "_norm.weight", "attn_sinks.weight"))


def check_tensors(spec: ArchSpec, shapes: Mapping[str, tuple[int, ...]], source: str,
                  types: Mapping[str, str] | None = None) -> None:
    """Every tensor llama.cpp creates is there with its shape and a type it can use, and every tensor in the file
    is one it creates."""
    required, optional = expected_shapes(spec, set(shapes))
    arch = spec.hparams.arch
    n_main = spec.hparams.n_layer - spec.hparams.n_nextn
    for name, t in (types or {}).items():
        layer = name.split(".")[1] if name.startswith("blk.") else ""
        if layer.isdigit() and int(layer) >= n_main:
            continue                  # NextN blocks are skipped at load: never computed
        if t != "F32" and _f32_only(name):
            raise GGUFError(f"{source}: tensor {name!r} is {t}; llama.cpp needs norm weights, biases and sinks as "
                            "F32 (its element-wise ops abort at the first decode otherwise)")
    for name, shape in shapes.items():
        want = required.get(name, optional.get(name))
        if want is None:
            raise GGUFError(f"{source}: tensor {name[:64]!r} is not one llama.cpp's {arch} loader creates "
                            f"(block_count {spec.hparams.n_layer}); llama.cpp refuses the file (wrong number of "
                            "tensors)")
        if _ne4(shape) != _ne4(want):
            raise GGUFError(f"{source}: tensor {name!r} has shape {list(shape)}, llama.cpp expects {list(want)} from "
                            "the metadata (wrong shape)")
    missing = [n for n in required if n not in shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GGUFError(f"{source}: missing tensor {missing[0]!r}{more}, which a {arch} model needs")


def check_dialect(inv: ModelInventory, dialect: str) -> None:
    """Types one dialect loads: mainline refuses ik_llama.cpp's own types (ids >= GGML_TYPE_COUNT)."""
    if dialect != "mainline":
        return
    for t in inv.tensors:
        if t.ggml_type not in MAINLINE_TYPES:
            raise InputError(f"tensor {t.name!r} has type {t.ggml_type}, which mainline llama.cpp does not load "
                             "(an ik_llama.cpp type): use --dialect ik")


def check_plan(plan: Plan, n_gpus: int | None, where: str) -> None:
    """A Plan from outside (a --plan file): device names that exist, knobs of the right types and ranges."""
    import dataclasses
    from .flags.common import DEVICE_RE
    from .plan import Knobs, OffloadPolicy, gpu_index
    for name, dev in plan.assignment.items():
        if not isinstance(dev, str) or DEVICE_RE.match(dev) is None:
            raise InputError(f"{where}: tensor {name!r} is placed on {str(dev)[:40]!r}, which is not a device name "
                             "(CPU, CUDA0, CUDA1, ...)")
        if n_gpus is not None and dev != "CPU" and gpu_index(dev) >= n_gpus:
            raise InputError(f"{where}: tensor {name!r} is placed on {dev}, but the hardware has "
                             f"{', '.join(['CPU'] + [f'CUDA{i}' for i in range(n_gpus)])}")
    base = Knobs()
    for f in dataclasses.fields(Knobs):
        v, ref = getattr(plan.knobs, f.name), getattr(base, f.name)
        if isinstance(ref, OffloadPolicy):
            ok = isinstance(v, OffloadPolicy) and all(
                isinstance(getattr(v, op).enabled, bool) and type(getattr(v, op).min_batch) is int
                and getattr(v, op).min_batch >= 0
                for op in ("dense_matmul", "moe_matmul", "moe_fused_up_gate", "output"))
        else:
            ok = type(v) is type(ref)
        if not ok:
            raise InputError(f"{where}: knob {f.name} is {str(v)[:40]!r}, expected {type(ref).__name__}")
    k = plan.knobs
    for fname, low in (("n_ctx", 1), ("n_batch", 1), ("n_ubatch", 1), ("n_seq", 1), ("n_threads", 0), ("amb", 0)):
        if not low <= getattr(k, fname) <= (1 << 31) - 1:
            raise InputError(f"{where}: knob {fname} is {getattr(k, fname)}, expected {low} to {(1 << 31) - 1}")
    from .plan import KV_TYPES
    for fname in ("type_k", "type_v"):
        if getattr(k, fname) not in KV_TYPES:
            raise InputError(f"{where}: knob {fname} is {getattr(k, fname)[:20]!r}; valid: {', '.join(KV_TYPES)}")
