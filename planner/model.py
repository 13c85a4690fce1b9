"""ModelInventory: a model's hyper-parameters and every tensor llama.cpp allocates, with its role and size.

Shapes are in GGUF/ggml order (ne0 first): an expert tensor `ffn_up_exps` is [n_embd, n_ff_exp, n_expert].
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

Role = Literal[
    "token_embd", "output", "output_norm", "attn", "norm", "ffn_dense", "ffn_shexp", "router",
    "exps_gate", "exps_up", "exps_down", "exps_gate_up", "nextn", "other",
]
EXPERT_ROLES: frozenset[str] = frozenset({"exps_gate", "exps_up", "exps_down", "exps_gate_up"})

# Tensor-name template -> role, first match wins (names from llama.cpp's llama-arch.cpp LLM_TENSOR_NAMES;
# docs/llamacpp.md section 1). Patterns match the part after "blk.N." (or the whole name).
_LAYER_ROLES: list[tuple[re.Pattern[str], Role]] = [(re.compile(p), r) for p, r in [
    (r"^nextn\.", "nextn"),
    (r"^ffn_gate_up_(ch|)exps\.", "exps_gate_up"),
    (r"^ffn_gate_(ch|)exps\.", "exps_gate"),
    (r"^ffn_up_(ch|)exps\.", "exps_up"),
    (r"^ffn_down_(ch|)exps\.", "exps_down"),
    (r"^ffn_(gate_inp_shexp|gate_shexp|up_shexp|down_shexp)\.", "ffn_shexp"),
    (r"^(ffn_gate_inp|exp_probs_b)\.", "router"),
    (r"^ffn_(gate|up|down)\.", "ffn_dense"),
    (r"^(attn_norm|ffn_norm|post_attention_norm|post_ffw_norm|attn_post_norm|ffn_post_norm|layer_output_norm)\.",
     "norm"),
    (r"^attn_", "attn"),
]]
_GLOBAL_ROLES: dict[str, Role] = {"token_embd": "token_embd", "output": "output", "output_norm": "output_norm"}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def classify(name: str) -> tuple[int | None, Role]:
    """(layer, role) of a tensor name; unknown names get role "other" (they still count toward memory)."""
    m = _BLK.match(name)
    if m is None:
        return None, _GLOBAL_ROLES.get(name.split(".", 1)[0], "other")
    layer, rest = int(m.group(1)), m.group(2)
    for pattern, role in _LAYER_ROLES:
        if pattern.search(rest):
            return layer, role
    return layer, "other"


@dataclass(frozen=True)
class Tensor:
    name: str
    layer: int | None
    role: Role
    shape: tuple[int, ...]
    ggml_type: str
    nbytes: int

    @property
    def is_expert(self) -> bool:
        return self.role in EXPERT_ROLES


@dataclass(frozen=True)
class Hparams:
    """What the memory and cost models need. Per-layer facts are tuples of length n_layer."""
    arch: str
    n_layer: int                 # block_count, as llama.cpp's n_layer_all: NextN/MTP blocks included (-ngl counts them)
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: tuple[int, ...]   # per layer (0 = no attention in that layer)
    head_dim_k: int
    head_dim_v: int
    n_ctx_train: int
    n_ff: int = 0                # dense FFN width (dense layers)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_expert_shared: int = 0
    n_ff_shexp: int = 0
    moe_layers: tuple[bool, ...] = ()   # per layer: has routed experts
    swa_layers: tuple[bool, ...] = ()   # per layer: sliding-window (or chunked) attention
    n_swa: int = 0
    mla_kv_lora_rank: int = 0    # > 0: MLA; the KV cache holds kv_lora_rank + n_rot per token (K only)
    n_rot: int = 0
    n_nextn: int = 0             # the last n_nextn blocks are NextN/MTP: in the file, never allocated

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_lora_rank > 0


@dataclass(frozen=True)
class ModelInventory:
    arch: str
    hparams: Hparams
    tensors: tuple[Tensor, ...]
    name: str = ""
    source: str = ""             # a path or "preset:NAME:QUANT"
    file_bytes: int = field(default=0, compare=False)

    @cached_property
    def by_name(self) -> dict[str, Tensor]:
        return {t.name: t for t in self.tensors}

    @cached_property
    def by_layer(self) -> dict[int | None, tuple[Tensor, ...]]:
        out: dict[int | None, list[Tensor]] = {}
        for t in self.tensors:
            out.setdefault(t.layer, []).append(t)
        return {k: tuple(v) for k, v in out.items()}

    @property
    def n_layer(self) -> int:
        return self.hparams.n_layer

    def layers(self) -> range:
        return range(self.hparams.n_layer)

    def moe_layers(self) -> list[int]:
        return [i for i in self.layers() if any(t.is_expert for t in self.by_layer.get(i, ()))]

    @property
    def tied_output(self) -> bool:
        """No output.weight: llama.cpp loads token_embd a second time as the output, on the output's device."""
        return "output.weight" not in self.by_name

    def allocated(self) -> tuple[Tensor, ...]:
        """Tensors llama.cpp allocates (NextN blocks are skipped at load)."""
        return tuple(t for t in self.tensors if t.role != "nextn")

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.allocated())

    def expert_bytes(self, layer: int) -> int:
        return sum(t.nbytes for t in self.by_layer.get(layer, ()) if t.is_expert)

    def active_bytes_per_token(self) -> int:
        """Weight bytes one decoded token reads: everything but unused experts and the embedding table."""
        hp = self.hparams
        total = 0
        for t in self.allocated():
            if t.role == "token_embd":
                total += t.nbytes // max(hp.n_vocab, 1)   # one row is read (GET_ROWS)
            elif t.is_expert and hp.n_expert:
                total += t.nbytes * hp.n_expert_used // hp.n_expert
            else:
                total += t.nbytes
        if self.tied_output:
            total += self.by_name["token_embd.weight"].nbytes
        return total

    def groups(self) -> dict[str, int]:
        """Bytes per role, for `inspect`."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.role] = out.get(t.role, 0) + t.nbytes
        return out
