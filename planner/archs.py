"""Per-architecture facts as data: GGUF metadata keys -> Hparams, and the tensors llama.cpp creates per layer.

Source: llama.cpp src/models/<arch>.cpp (load_arch_hparams / load_arch_tensors) of the version vendored in
llama-cpp-python 0.3.36 (docs/llamacpp.md section 10), and llama-hparams.cpp for the
sliding-window pattern (is_swa[il] = il % n_pattern < n_pattern - 1). The same tables drive presets
(planner/presets) and the synthetic GGUF writer (runtime/synth.py), so a preset and a synthetic file of the
same hparams have identical inventories.

Shapes use dimension names resolved per layer by `_dims`; ggml order (ne0 first).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from .errors import GGUFError, UnknownArchitectureError
from .model import Hparams, ModelInventory, Tensor, classify

# Layer conditions a tensor row can carry.
#   all: every layer; dense: layers without routed experts; moe: layers with them; shexp: MoE layers with
#   shared experts; q_lora / no_q_lora: MLA with or without the low-rank Q; qk_norm, qkv_bias, probs_b: features.
_ATTN = [
    ("attn_norm.weight", ("E",), "all"),
    ("attn_q.weight", ("E", "q"), "all"), ("attn_k.weight", ("E", "k"), "all"), ("attn_v.weight", ("E", "v"), "all"),
    ("attn_q.bias", ("q",), "qkv_bias"), ("attn_k.bias", ("k",), "qkv_bias"), ("attn_v.bias", ("v",), "qkv_bias"),
    ("attn_output.weight", ("o", "E"), "all"),
    ("attn_q_norm.weight", ("Dk",), "qk_norm"), ("attn_k_norm.weight", ("Dk",), "qk_norm"),
]
_DENSE_FFN = [
    ("ffn_gate.weight", ("E", "F"), "dense"), ("ffn_down.weight", ("F", "E"), "dense"),
    ("ffn_up.weight", ("E", "F"), "dense"),
]
_ROUTED = [
    ("ffn_gate_inp.weight", ("E", "X"), "moe"),
    ("ffn_gate_exps.weight", ("E", "Fe", "X"), "moe"), ("ffn_down_exps.weight", ("Fe", "E", "X"), "moe"),
    ("ffn_up_exps.weight", ("E", "Fe", "X"), "moe"),
]
_SHARED = [
    ("ffn_gate_shexp.weight", ("E", "Fs"), "shexp"), ("ffn_down_shexp.weight", ("Fs", "E"), "shexp"),
    ("ffn_up_shexp.weight", ("E", "Fs"), "shexp"),
]
_FFN_NORM = [("ffn_norm.weight", ("E",), "all")]

LAYER_TENSORS: dict[str, list[tuple[str, tuple[str, ...], str]]] = {
    "llama": _ATTN + _FFN_NORM + _DENSE_FFN,
    "qwen2": _ATTN + _FFN_NORM + _DENSE_FFN,
    "qwen3": _ATTN + _FFN_NORM + _DENSE_FFN,
    "qwen3moe": _ATTN + _FFN_NORM + _ROUTED,
    "qwen2moe": _ATTN + _FFN_NORM + _ROUTED + [("ffn_gate_inp_shexp.weight", ("E",), "shexp")] + _SHARED,
    "llama4": _ATTN + _FFN_NORM + _ROUTED + _SHARED + _DENSE_FFN,
    "glm4moe": _ATTN + [("post_attention_norm.weight", ("E",), "all"), ("exp_probs_b.bias", ("X",), "moe")]
    + _ROUTED + _SHARED + _DENSE_FFN,
    "gpt-oss": [
        ("attn_norm.weight", ("E",), "all"), ("post_attention_norm.weight", ("E",), "all"),
        ("attn_q.weight", ("E", "q"), "all"), ("attn_k.weight", ("E", "k"), "all"),
        ("attn_v.weight", ("E", "v"), "all"),
        ("attn_q.bias", ("q",), "all"), ("attn_k.bias", ("k",), "all"), ("attn_v.bias", ("v",), "all"),
        ("attn_output.weight", ("o", "E"), "all"), ("attn_output.bias", ("E",), "all"),
        ("attn_sinks.weight", ("H",), "all"),
        ("ffn_gate_inp.weight", ("E", "X"), "moe"), ("ffn_gate_inp.bias", ("X",), "moe"),
        ("ffn_gate_exps.weight", ("E", "Fe", "X"), "moe"), ("ffn_down_exps.weight", ("Fe", "E", "X"), "moe"),
        ("ffn_up_exps.weight", ("E", "Fe", "X"), "moe"),
        ("ffn_gate_exps.bias", ("Fe", "X"), "moe"), ("ffn_down_exps.bias", ("E", "X"), "moe"),
        ("ffn_up_exps.bias", ("Fe", "X"), "moe"),
    ],
    "deepseek2": [
        ("attn_norm.weight", ("E",), "all"),
        ("attn_q_a_norm.weight", ("ql",), "q_lora"), ("attn_kv_a_norm.weight", ("kvl",), "all"),
        ("attn_q_a.weight", ("E", "ql"), "q_lora"), ("attn_q_b.weight", ("ql", "qm"), "q_lora"),
        ("attn_q.weight", ("E", "qm"), "no_q_lora"),
        ("attn_kv_a_mqa.weight", ("E", "kva"), "all"),
        ("attn_k_b.weight", ("nope", "kvl", "H"), "all"), ("attn_v_b.weight", ("kvl", "Dvm", "H"), "all"),
        ("attn_output.weight", ("om", "E"), "all"),
        ("ffn_norm.weight", ("E",), "all"),
        ("ffn_gate.weight", ("E", "F"), "dense"), ("ffn_down.weight", ("F", "E"), "dense"),
        ("ffn_up.weight", ("E", "F"), "dense"),
        ("ffn_gate_inp.weight", ("E", "X"), "moe"), ("exp_probs_b.bias", ("X",), "probs_b"),
        ("ffn_gate_exps.weight", ("E", "Fe", "X"), "moe"), ("ffn_down_exps.weight", ("Fe", "E", "X"), "moe"),
        ("ffn_up_exps.weight", ("E", "Fe", "X"), "moe"),
    ] + _SHARED,
}
# Tensors of a NextN/MTP block (glm4moe, deepseek2) besides a full layer's: present in files, never allocated.
NEXTN_TENSORS = [("nextn.eh_proj.weight", ("E2", "E")), ("nextn.enorm.weight", ("E",)),
                 ("nextn.hnorm.weight", ("E",)), ("nextn.shared_head_norm.weight", ("E",))]

# Features implied by the architecture (qwen3 has QK-norm, qwen2 Q/K/V biases ...). glm4moe's QK-norm and
# deepseek2's exp_probs_b depend on the model and come from the file (or the preset's "features").
ARCH_FEATURES: dict[str, frozenset[str]] = {
    "llama": frozenset(), "qwen2": frozenset({"qkv_bias"}), "qwen3": frozenset({"qk_norm"}),
    "qwen3moe": frozenset({"qk_norm"}), "qwen2moe": frozenset({"qkv_bias"}), "llama4": frozenset(),
    "glm4moe": frozenset({"qkv_bias"}), "gpt-oss": frozenset(), "deepseek2": frozenset(),
}
SUPPORTED_ARCHS = tuple(LAYER_TENSORS)
# the architectures whose loaders read <arch>.leading_dense_block_count (the pinned mainline's src/models/*.cpp
# load_arch_hparams: deepseek2.cpp and glm4-moe.cpp among ours); qwen3moe, qwen2moe, gpt-oss and llama4 never read
# it, so a file that sets it still loads with every layer MoE there (issue 43: it was a false refusal)
LEADING_DENSE_ARCHS = frozenset({"deepseek2", "glm4moe"})
SWA_PATTERN = {"gpt-oss": 2, "llama4": 4}   # load_swa_pattern(ml, N) in the arch's load_arch_hparams
DEFAULT_SWA = {"llama4": 8192}              # llama4: chunked attention, n_swa = 8192 unless the file says 0


@dataclass(frozen=True)
class ArchSpec:
    """Hparams plus the few layout facts the per-layer table needs."""
    hparams: Hparams
    features: frozenset[str]
    q_lora_rank: int = 0
    head_dim_k_mla: int = 0
    head_dim_v_mla: int = 0


def require_arch(arch: str) -> None:
    if arch not in LAYER_TENSORS:
        raise UnknownArchitectureError(
            f"unknown architecture {arch!r}: offload-tuner models {', '.join(SUPPORTED_ARCHS)}")


def _dims(spec: ArchSpec, il: int) -> dict[str, int]:
    hp = spec.hparams
    hkv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
    d = {"E": hp.n_embd, "E2": 2 * hp.n_embd, "V": hp.n_vocab, "H": hp.n_head, "Dk": hp.head_dim_k,
         "q": hp.n_head * hp.head_dim_k, "k": hkv * hp.head_dim_k, "v": hkv * hp.head_dim_v,
         "o": hp.n_head * hp.head_dim_v, "F": hp.n_ff, "Fe": hp.n_ff_exp, "X": hp.n_expert,
         "Fs": hp.n_ff_shexp}
    if hp.is_mla:
        d.update(ql=spec.q_lora_rank, kvl=hp.mla_kv_lora_rank, kva=hp.mla_kv_lora_rank + hp.n_rot,
                 qm=hp.n_head * spec.head_dim_k_mla, nope=spec.head_dim_k_mla - hp.n_rot,
                 Dvm=spec.head_dim_v_mla, om=hp.n_head * spec.head_dim_v_mla)
    return d


def _applies(cond: str, spec: ArchSpec, il: int) -> bool:
    hp = spec.hparams
    moe = hp.moe_layers[il] if il < len(hp.moe_layers) else False
    return {
        "all": True, "dense": not moe, "moe": moe, "shexp": moe and hp.n_ff_shexp > 0,
        "q_lora": spec.q_lora_rank > 0, "no_q_lora": spec.q_lora_rank == 0,
        "qk_norm": "qk_norm" in spec.features, "qkv_bias": "qkv_bias" in spec.features,
        "probs_b": moe and "probs_b" in spec.features,
    }[cond]


def tensor_shapes(spec: ArchSpec, tied_output: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a GGUF of this arch holds, in the order converters write them."""
    hp = spec.hparams
    require_arch(hp.arch)
    out = [("token_embd.weight", (hp.n_embd, hp.n_vocab))]
    n_main = hp.n_layer - hp.n_nextn
    for il in range(hp.n_layer):
        dims = _dims(spec, il)
        for suffix, shape, cond in LAYER_TENSORS[hp.arch]:
            if _applies(cond, spec, il):
                out.append((f"blk.{il}.{suffix}", tuple(dims[s] for s in shape)))
        if il >= n_main:
            out.extend((f"blk.{il}.{suffix}", tuple(dims[s] for s in shape)) for suffix, shape in NEXTN_TENSORS)
    out.append(("output_norm.weight", (hp.n_embd,)))
    if not tied_output:
        out.append(("output.weight", (hp.n_embd, hp.n_vocab)))
    return out


def make_tensor(hp: Hparams, name: str, shape: tuple[int, ...], ggml_type: str, nbytes: int) -> Tensor:
    layer, role = classify(name)
    if layer is not None and layer >= hp.n_layer - hp.n_nextn:
        role = "nextn"   # llama.cpp creates NextN blocks with TENSOR_SKIP: in the file, never allocated
    return Tensor(name, layer, role, tuple(shape), ggml_type, nbytes)


def build_inventory(spec: ArchSpec, type_of: Callable[[str, tuple[int, ...], int | None], str],
                    tied_output: bool = False, name: str = "", source: str = "") -> ModelInventory:
    """Inventory from hparams and a quant recipe `type_of(name, shape, layer) -> ggml type name`."""
    from .ggml_types import by_name
    tensors = []
    for tname, shape in tensor_shapes(spec, tied_output):
        layer, _ = classify(tname)
        tt = type_of(tname, shape, layer)
        tensors.append(make_tensor(spec.hparams, tname, shape, tt, by_name(tt).nbytes(shape)))
    inv = ModelInventory(spec.hparams.arch, spec.hparams, tuple(tensors), name=name, source=source)
    return replace(inv, file_bytes=inv.total_bytes())


# ---- GGUF metadata <-> hparams -------------------------------------------------------------------------------

# Bounds on what metadata may declare (llama-hparams.h LLAMA_MAX_LAYERS / LLAMA_MAX_EXPERTS; sizes far above any
# real model), so a hostile header cannot make us build huge per-layer tuples or divide by zero.
MAX_LAYERS = 512
MAX_EXPERTS = 1024
MAX_DIM = 1 << 32


def _get(meta: Mapping[str, Any], arch: str, key: str, default: Any = None, required: bool = False) -> Any:
    full = f"{arch}.{key}"
    if full in meta:
        return meta[full]
    if required:
        raise GGUFError(f"GGUF metadata lacks {full!r}, which a {arch} model needs")
    return default


def _check_int(value: Any, what: str, lo: int = 0, hi: int = MAX_DIM) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise GGUFError(f"GGUF metadata {what} is {value!r:.60}, expected an integer from {lo} to {hi}")
    return value


def _int(meta: Mapping[str, Any], arch: str, key: str, default: Any = None, required: bool = False,
         lo: int = 0, hi: int = MAX_DIM) -> int:
    return _check_int(_get(meta, arch, key, default, required), f"{arch}.{key}", lo, hi)


def _int_or_max(meta: Mapping[str, Any], arch: str, key: str, default: Any = None, required: bool = False,
                lo: int = 0) -> int:
    """A scalar, or the largest entry of a per-layer array (llama.cpp sizes per-layer tensors by each entry)."""
    value = _get(meta, arch, key, default, required)
    if isinstance(value, (list, tuple)):
        value = max((_check_int(v, f"{arch}.{key}") for v in value), default=0)
    return _check_int(value, f"{arch}.{key}", lo)


def _per_layer(value: Any, n: int, what: str) -> tuple[int, ...]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise GGUFError(f"{what} has {len(value)} entries for {n} layers")
        return tuple(_check_int(v, what) for v in value)
    return (_check_int(value, what),) * n


def _swa_layers(meta: Mapping[str, Any], arch: str, n_layer: int, n_nextn: int, n_swa: int) -> tuple[bool, ...]:
    """llama_model_base::load_swa_pattern + llama_hparams::set_swa_pattern: a per-layer array, or a period
    n (layer il is SWA when il % n < n - 1; n == 0: every layer); NextN layers never."""
    n_main = n_layer - n_nextn
    pattern = _get(meta, arch, "attention.sliding_window_pattern", SWA_PATTERN.get(arch, 0))
    if isinstance(pattern, (list, tuple)):
        return tuple(bool(v) for v in _per_layer([int(bool(v)) for v in pattern], n_layer,
                                                 f"{arch}.attention.sliding_window_pattern"))
    if arch not in SWA_PATTERN or n_swa == 0:
        return (False,) * n_layer
    p = _check_int(pattern, f"{arch}.attention.sliding_window_pattern")
    return tuple(il < n_main and (p == 0 or il % p < p - 1) for il in range(n_layer))


def spec_from_metadata(meta: Mapping[str, Any], tensor_names: set[str] | None = None) -> ArchSpec:
    """Read hparams the way llama.cpp's load_arch_hparams does, for the architectures we model.

    block_count counts NextN/MTP blocks too (llama.cpp's n_layer_all); Hparams.n_layer is that count."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError("GGUF metadata lacks general.architecture")
    require_arch(arch)
    n_layer = _int(meta, arch, "block_count", required=True, lo=1, hi=MAX_LAYERS)
    n_embd = _int(meta, arch, "embedding_length", required=True, lo=1)
    n_head = _int_or_max(meta, arch, "attention.head_count", required=True, lo=1)
    n_head_kv = _per_layer(_get(meta, arch, "attention.head_count_kv", n_head), n_layer,
                           f"{arch}.attention.head_count_kv")
    head_dim_k = _int(meta, arch, "attention.key_length", n_embd // n_head)
    head_dim_v = _int(meta, arch, "attention.value_length", head_dim_k)
    n_vocab = _get(meta, arch, "vocab_size")
    if n_vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        n_vocab = len(tokens) if isinstance(tokens, Sequence) and not isinstance(tokens, str) else None
    if n_vocab is None:
        raise GGUFError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    n_vocab = _check_int(n_vocab, f"{arch}.vocab_size", lo=1)
    n_expert = _int(meta, arch, "expert_count", 0, hi=MAX_EXPERTS)
    n_expert_used = _int(meta, arch, "expert_used_count", 0, hi=max(n_expert, 1))
    n_ff = _int_or_max(meta, arch, "feed_forward_length", 0)
    n_ff_exp = _int_or_max(meta, arch, "expert_feed_forward_length", 0)
    if arch in ("glm4moe", "qwen3moe", "qwen2moe") and n_ff_exp == 0 and n_expert:
        n_ff_exp = n_ff // max(n_expert_used, 1)     # <arch>.cpp: n_ff_exp() ? n_ff_exp() : n_ff / n_expert_used
    n_shared = _int(meta, arch, "expert_shared_count", 0, hi=MAX_EXPERTS)
    n_ff_shexp = _int(meta, arch, "expert_shared_feed_forward_length", 0)
    if arch == "qwen2moe" and n_expert and not n_ff_shexp:
        n_ff_shexp = n_ff                         # qwen2moe.cpp: n_ff_shexp ? n_ff_shexp : n_ff
    if arch in ("deepseek2", "glm4moe") and n_shared:
        n_ff_shexp = n_ff_exp * n_shared          # these archs size the shared expert from n_ff_exp
    if arch == "llama4" and n_expert:
        n_shared, n_ff_shexp = 1, n_ff_exp        # llama4.cpp: one shared expert of n_ff_exp, whatever the key says
    n_nextn = _int(meta, arch, "nextn_predict_layers", 0, hi=n_layer)
    lead = _int(meta, arch, "leading_dense_block_count", 0) if arch in LEADING_DENSE_ARCHS else 0
    step = _int(meta, arch, "interleave_moe_layer_step", 1 if arch == "llama4" else 0)
    if n_expert == 0:
        moe = (False,) * n_layer
    elif arch == "llama4":
        moe = tuple(step > 0 and (i + 1) % step == 0 for i in range(n_layer))
    else:
        moe = tuple(i >= lead for i in range(n_layer))
    n_swa = _int(meta, arch, "attention.sliding_window", DEFAULT_SWA.get(arch, 0))
    swa = _swa_layers(meta, arch, n_layer, n_nextn, n_swa)
    kv_lora = _int(meta, arch, "attention.kv_lora_rank", 0)
    k_mla = _int(meta, arch, "attention.key_length_mla", 0)
    v_mla = _int(meta, arch, "attention.value_length_mla", 0)
    n_rot = _int(meta, arch, "rope.dimension_count", head_dim_k)
    q_lora = _int(meta, arch, "attention.q_lora_rank", 0)
    if arch == "deepseek2" and not (k_mla and v_mla and kv_lora and 0 < n_rot < k_mla):
        raise GGUFError("deepseek2 GGUF without MLA metadata (attention.key_length_mla, value_length_mla, "
                        "kv_lora_rank; old converts with attn_kv_b) is not supported: use a newer conversion")
    features = set(ARCH_FEATURES[arch])
    names = tensor_names or set()
    if any(n.endswith("attn_q_norm.weight") for n in names):
        features.add("qk_norm")
    if any(n.endswith("exp_probs_b.bias") for n in names):
        features.add("probs_b")
    hp = Hparams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_vocab=n_vocab, n_head=n_head, n_head_kv=n_head_kv,
        head_dim_k=head_dim_k, head_dim_v=head_dim_v,
        n_ctx_train=_int(meta, arch, "context_length", 4096, hi=1 << 40), n_ff=n_ff, n_expert=n_expert,
        n_expert_used=n_expert_used, n_ff_exp=n_ff_exp,
        n_expert_shared=n_shared, n_ff_shexp=n_ff_shexp, moe_layers=moe, swa_layers=swa,
        n_swa=n_swa if any(swa) else 0, mla_kv_lora_rank=kv_lora if (k_mla and v_mla) else 0,
        n_rot=n_rot, n_nextn=n_nextn,
    )
    return ArchSpec(hp, frozenset(features), q_lora_rank=q_lora, head_dim_k_mla=k_mla, head_dim_v_mla=v_mla)


def metadata_for(spec: ArchSpec) -> dict[str, Any]:
    """GGUF metadata (without general.* and tokenizer.*) that spec_from_metadata reads back to `spec`."""
    hp, a = spec.hparams, spec.hparams.arch
    m: dict[str, Any] = {
        f"{a}.block_count": hp.n_layer, f"{a}.context_length": hp.n_ctx_train, f"{a}.embedding_length": hp.n_embd,
        f"{a}.attention.head_count": hp.n_head,
        f"{a}.attention.head_count_kv": hp.n_head_kv[0] if len(set(hp.n_head_kv)) == 1 else list(hp.n_head_kv),
        f"{a}.attention.key_length": hp.head_dim_k, f"{a}.attention.value_length": hp.head_dim_v,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6, f"{a}.rope.dimension_count": hp.n_rot,
        f"{a}.rope.freq_base": 10000.0, f"{a}.vocab_size": hp.n_vocab,
    }
    if hp.n_ff:
        m[f"{a}.feed_forward_length"] = hp.n_ff
    if hp.n_expert:
        m[f"{a}.expert_count"] = hp.n_expert
        m[f"{a}.expert_used_count"] = hp.n_expert_used
        m[f"{a}.expert_feed_forward_length"] = hp.n_ff_exp
    if hp.n_expert_shared:
        m[f"{a}.expert_shared_count"] = hp.n_expert_shared
    if hp.n_ff_shexp and a == "qwen2moe":
        m[f"{a}.expert_shared_feed_forward_length"] = hp.n_ff_shexp
    lead = next((i for i, moe in enumerate(hp.moe_layers) if moe), 0)
    if a in ("deepseek2", "glm4moe"):
        m[f"{a}.leading_dense_block_count"] = lead
        m[f"{a}.expert_gating_func"] = 2 if "probs_b" in spec.features or a == "glm4moe" else 1
        m[f"{a}.expert_weights_scale"] = 1.0
        m[f"{a}.expert_weights_norm"] = True
    if a == "llama4":
        step = next((i + 1 for i, moe in enumerate(hp.moe_layers) if moe), 1)
        m[f"{a}.interleave_moe_layer_step"] = step
    if hp.n_swa:
        m[f"{a}.attention.sliding_window"] = hp.n_swa
    if hp.n_nextn:
        m[f"{a}.nextn_predict_layers"] = hp.n_nextn
    if hp.is_mla:
        m[f"{a}.attention.kv_lora_rank"] = hp.mla_kv_lora_rank
        m[f"{a}.attention.key_length_mla"] = spec.head_dim_k_mla
        m[f"{a}.attention.value_length_mla"] = spec.head_dim_v_mla
        if spec.q_lora_rank:
            m[f"{a}.attention.q_lora_rank"] = spec.q_lora_rank
    return m
