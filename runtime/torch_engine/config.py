"""What the forward pass needs to know about a model, derived from its ModelInventory (and GGUF metadata).

Facts per architecture follow llama.cpp's graph builders (src/models/<arch>.cpp of the vendored 0.3.36 tree):
- qwen3moe: QK-norm, NEOX RoPE, softmax routing with renormalised top-k weights.
- qwen2moe: Q/K/V biases, NEOX RoPE, softmax routing without renormalisation, a shared expert scaled by
  sigmoid(ffn_gate_inp_shexp . x).
- deepseek2: MLA with the absorbed latent cache (kv_lora_rank + n_rot per token), NORM (interleaved) RoPE on the
  rope part, dense leading layers, sigmoid routing (expert_gating_func 2) with exp_probs_b added for selection
  only, normalised weights times expert_weights_scale, shared experts added unscaled.
- gpt-oss (openai-moe.cpp): biases on Q/K/V/O and experts, attention sinks, sliding window (n_swa) on the
  layers marked in hparams.swa_layers, NEOX RoPE, router logits + bias, top-k on logits then softmax over the
  chosen k (SOFTMAX_WEIGHT), swiglu_oai(gate, up) = min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1).
Not modelled: RoPE scaling (YaRN) and DeepSeek's yarn mscale on kq_scale, so real-file logits of models
trained with them differ from llama.cpp's; speed and placement are unaffected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal
from collections.abc import Mapping

from planner.errors import InputError
from planner.model import ModelInventory

RopeType = Literal["neox", "norm"]
Gating = Literal["softmax", "sigmoid", "softmax_weight"]
Activation = Literal["silu", "swiglu_oai"]

SUPPORTED = ("qwen3moe", "qwen2moe", "deepseek2", "gpt-oss")
ROPE_TYPE: dict[str, RopeType] = {"qwen3moe": "neox", "qwen2moe": "neox", "gpt-oss": "neox", "deepseek2": "norm"}
SWIGLU_OAI_ALPHA = 1.702      # llama-graph.cpp build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE
SWIGLU_OAI_LIMIT = 7.0


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layer: int                  # blocks that run (NextN/MTP blocks excluded)
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: tuple[int, ...]
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    rope_type: RopeType
    rope_base: float
    rms_eps: float
    moe_layers: tuple[bool, ...]
    swa_layers: tuple[bool, ...]
    n_swa: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    gating: Gating
    norm_topk: bool
    expert_weights_scale: float   # 0 or 1: not applied (llama-graph.cpp)
    activation: Activation
    qk_norm: bool
    shexp_gate: bool              # qwen2moe: shared expert scaled by sigmoid(gate_inp_shexp . x)
    sinks: bool
    tied_output: bool
    # MLA (deepseek2)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    head_dim_k_mla: int = 0
    head_dim_v_mla: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kq_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim_k_mla if self.is_mla else self.head_dim_k)


def _meta(meta: Mapping[str, Any], arch: str, key: str, default: Any) -> Any:
    return meta.get(f"{arch}.{key}", default)


def config_from_inventory(inv: ModelInventory, metadata: Mapping[str, Any] | None = None) -> ModelConfig:
    """The forward pass's view of `inv`; `metadata` (a GGUF's) supplies eps, RoPE base and routing details,
    else llama.cpp's defaults for the arch (what runtime.synth writes: eps 1e-6, base 10000)."""
    hp, arch, meta = inv.hparams, inv.arch, metadata or {}
    if arch not in SUPPORTED:
        raise InputError(f"the torch engine runs {', '.join(SUPPORTED)}; {arch!r} is not one of them")
    names = inv.by_name
    n_main = hp.n_layer - hp.n_nextn
    q_lora = k_mla = v_mla = 0
    if hp.is_mla:
        k_b = names.get("blk.0.attn_k_b.weight")
        v_b = names.get("blk.0.attn_v_b.weight")
        q_a = names.get("blk.0.attn_q_a.weight")
        if k_b is None or v_b is None:
            raise InputError("deepseek2 model without attn_k_b/attn_v_b (an old conversion): not supported")
        k_mla, v_mla = k_b.shape[0] + hp.n_rot, v_b.shape[1]       # ggml shapes [nope, kvl, H], [kvl, Dv, H]
        q_lora = q_a.shape[1] if q_a is not None else 0
    has_probs_b = any(n.endswith("exp_probs_b.bias") for n in names)
    gating: Gating = "softmax"
    norm_topk = arch == "qwen3moe"
    scale = 0.0
    if arch == "deepseek2":
        gating = "sigmoid" if int(_meta(meta, arch, "expert_gating_func", 2 if has_probs_b else 1)) == 2 else "softmax"
        norm_topk = bool(_meta(meta, arch, "expert_weights_norm", True))
        scale = float(_meta(meta, arch, "expert_weights_scale", 1.0))
    elif arch == "gpt-oss":
        gating = "softmax_weight"
    return ModelConfig(
        arch=arch, n_layer=n_main, n_embd=hp.n_embd, n_vocab=hp.n_vocab, n_head=hp.n_head,
        n_head_kv=tuple(hp.n_head_kv[:n_main]), head_dim_k=hp.head_dim_k, head_dim_v=hp.head_dim_v,
        n_rot=hp.n_rot or hp.head_dim_k, rope_type=ROPE_TYPE[arch],
        rope_base=float(_meta(meta, arch, "rope.freq_base", 10000.0)),
        rms_eps=float(_meta(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        moe_layers=tuple(hp.moe_layers[:n_main]), swa_layers=tuple(hp.swa_layers[:n_main]) or (False,) * n_main,
        n_swa=hp.n_swa, n_expert=hp.n_expert, n_expert_used=hp.n_expert_used, n_ff_exp=hp.n_ff_exp,
        gating=gating, norm_topk=norm_topk, expert_weights_scale=scale,
        activation="swiglu_oai" if arch == "gpt-oss" else "silu",
        qk_norm="blk.0.attn_q_norm.weight" in names, shexp_gate=arch == "qwen2moe",
        sinks="blk.0.attn_sinks.weight" in names, tied_output=inv.tied_output,
        kv_lora_rank=hp.mla_kv_lora_rank, q_lora_rank=q_lora, head_dim_k_mla=k_mla, head_dim_v_mla=v_mla,
    )
