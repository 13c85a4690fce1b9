"""Plan: which device holds every tensor, plus the run-time knobs. The single source of truth for flags.

A Plan serialises to canonical JSON (sorted keys, no whitespace variation) and its id is a hash of that, so the
same placement and knobs always get the same id across runs and machines.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

Dialect = Literal["mainline", "ik"]
DIALECTS: tuple[str, ...] = ("mainline", "ik")
OpClass = Literal["dense_matmul", "moe_matmul", "moe_fused_up_gate", "output"]
OP_CLASSES: tuple[str, ...] = ("dense_matmul", "moe_matmul", "moe_fused_up_gate", "output")
KvType = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"]
KV_TYPES: tuple[str, ...] = get_args(KvType)
DEFAULT_MIN_BATCH = 32   # ggml-backend.cpp: GGML_OP_OFFLOAD_MIN_BATCH default


DEFAULT_CTX = 8192     # the context every command plans for unless told (--ctx): one default everywhere


@dataclass(frozen=True)
class OpRule:
    enabled: bool = True
    min_batch: int = DEFAULT_MIN_BATCH


@dataclass(frozen=True)
class OffloadPolicy:
    """Whether an op on a RAM-resident weight runs on the GPU (weight uploaded) once its batch >= min_batch."""
    dense_matmul: OpRule = OpRule()
    moe_matmul: OpRule = OpRule()
    moe_fused_up_gate: OpRule = OpRule()
    output: OpRule = OpRule()

    def rule(self, op: str) -> OpRule:
        return getattr(self, op)

    @classmethod
    def all(cls, enabled: bool = True, min_batch: int = DEFAULT_MIN_BATCH) -> OffloadPolicy:
        r = OpRule(enabled, min_batch)
        return cls(r, r, r, r)

    @property
    def any_enabled(self) -> bool:
        return any(self.rule(op).enabled for op in OP_CLASSES)


# KV cache types that are not quantized: a quantized V cache needs flash attention (mainline src/llama-context.cpp
# "quantized V cache requires flash_attn", ik common/common.cpp "Quantized V cache cannot be used without flash
# attention")
FULL_PRECISION_KV = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class Knobs:
    n_ctx: int = DEFAULT_CTX
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int = 0            # 0: llama.cpp's default (physical cores)
    flash_attn: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    offload: OffloadPolicy = OffloadPolicy()
    only_active_experts: bool = True
    n_seq: int = 1
    no_kv_offload: bool = False
    mmap: bool = True
    swa_full: bool = False
    # mainline only: --no-host. Weights kept in RAM skip the GPU's pinned host buffer, so the CPU backend may
    # repack them (CPU_REPACK); repacked weights are never op-offloaded (docs/llamacpp.md section 11)
    no_host: bool = False
    # ik_llama.cpp extras
    mla: int = 3
    amb: int = 0                  # attention max batch (MiB); 0 = off
    fmoe: bool = True
    rtr: bool = False

    @property
    def n_ubatch_eff(self) -> int:
        """llama.cpp clamps the batch to the context and the ubatch to the batch (llama-context.cpp:
        n_batch = min(n_ctx, n_batch); n_ubatch = min(n_batch, n_ubatch))."""
        return min(self.n_ctx, self.n_batch, self.n_ubatch)

    @property
    def kv_size(self) -> int:
        """KV cells: n_ctx padded up to a multiple of 256 (llama-context.cpp sched_reserve)."""
        return -(-self.n_ctx // 256) * 256


# Knobs added after plans were stored (studies, plan files): left out of Plan.to_dict at their default, so a plan
# id (a hash of that JSON) stays what it was before the knob existed.
LATER_KNOBS: dict[str, object] = {"no_host": False}


@dataclass(frozen=True)
class Plan:
    model_id: str
    assignment: dict[str, str]    # tensor name -> device ("CPU", "CUDA0", ...)
    knobs: Knobs = Knobs()
    dialect: Dialect = "mainline"
    label: str = field(default="", compare=False)

    def devices(self) -> list[str]:
        return sorted(set(self.assignment.values()), key=device_sort_key)

    def to_dict(self) -> dict:
        knobs = dataclasses.asdict(self.knobs)
        for name, default in LATER_KNOBS.items():     # written only when set: older plans keep their ids
            if knobs[name] == default:
                del knobs[name]
        return {"model_id": self.model_id, "dialect": self.dialect, "assignment": dict(sorted(self.assignment.items())),
                "knobs": knobs, "label": self.label}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def id(self) -> str:
        d = self.to_dict()
        d.pop("label")
        return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        k = dict(d.get("knobs", {}))
        if "offload" in k:
            k["offload"] = OffloadPolicy(**{op: OpRule(**r) for op, r in k["offload"].items()})
        return cls(model_id=d["model_id"], assignment=dict(d["assignment"]), knobs=Knobs(**k),
                   dialect=d.get("dialect", "mainline"), label=d.get("label", ""))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


_GPU_RE = re.compile(r"^CUDA(\d+)$")


def is_gpu(device: str) -> bool:
    """A device name llama.cpp gives a CUDA GPU: CUDA0, CUDA1, ..."""
    return _GPU_RE.match(device) is not None


def gpu_index(device: str) -> int:
    """3 for CUDA3; ValueError for anything that is not a CUDA device name (CPU included)."""
    m = _GPU_RE.match(device)
    if m is None:
        raise ValueError(device)
    return int(m.group(1))


def device_sort_key(dev: str) -> tuple[int, int]:
    """CUDA0 < CUDA1 < ... < CPU."""
    return (0, gpu_index(dev)) if is_gpu(dev) else (1, 0)


def gpu_names(n: int) -> list[str]:
    return [f"CUDA{i}" for i in range(n)]
