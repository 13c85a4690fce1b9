"""Bytes per device and component (weights, kv, compute, overhead) of a Plan, per dialect.

Facts: docs/llamacpp.md sections 2-6, checked against llama.cpp's llama-context.cpp and
llama-kv-cache(-iswa).cpp of the vendored version. A layer's KV cache and activations live on the layer's
*home* device: the device its -ngl slot gives it, which in a Plan is the device of `blk.N.attn_norm.weight`
(flags/ never overrides a norm, so the two agree).

Compute buffers are what ggml-alloc reserves per device for the worst-case graphs (sched_reserve): we rebuild
llama.cpp's graph for the plan's ubatch (planner/llama_graph.py: every f32 activation, the graph inputs such as
the KQ mask, positions and KV store indices, n_outputs = the effective ubatch for the output, the Hadamard
copies of a quantized KV cache, the F16 mask of flash attention), let the scheduler's rules place each node
(op offload of RAM-resident weights included: their copies land in the GPU's buffer), and replay the allocator
(planner/ggml_graph.py). Summing live sets per phase is not enough: the allocator's best-fit free list leaves
holes, and the high-water mark it reports is 0-40% above the largest live set on the tiny models of the
integration test (tests/planner/test_memory_llamacpp.py), which holds weights, KV and compute to llama.cpp's
own numbers. The ik dialect replays ik_llama.cpp's own graph (its fused norm, MoE and FFN ops, its MLA attention for
each -mla and -amb, no graph outputs) with ik's scheduler rules (no CUDA fusion keep-alives, ik's op-offload batch
sizes, one reservation made with every op's offload on): byte for byte ik's logged compute buffers on the H100 report
and the CPU build's tiny models, DeepSeek's MLA included (tests/planner/test_memory_ik_h100.py,
tests/runtime/test_ik_binaries.py; docs/ik_llama.md). Its weights include the attn_kv_b ik computes at load for
-mla 0/2/3 (ik_wkv_b_bytes), and -mla is the one ik runs (ik_mla_plan).

ik's GPUs also hold its CUDA pool (pool_bytes): the temporaries of its flash attention and of its MoE ops, which
grow with the ubatch and appear in no buffer line ik logs.
"""
from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace as dc_replace
from collections.abc import Sequence

from .ggml_graph import GT, Compiled, allocate_compiled
from .ggml_types import by_name
from .hardware import MiB, HardwareProfile
from .llama_graph import TIED_OUTPUT, GraphParams, build_graph
from .model import ModelInventory, Tensor
from .plan import OP_CLASSES, Knobs, OffloadPolicy, Plan, device_sort_key, gpu_index

# Bytes per element of a KV row for each cache type (docs/llamacpp.md section 5; ggml type table).
KV_TYPE = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1",
           "q5_0": "Q5_0", "q5_1": "Q5_1", "iq4_nl": "IQ4_NL"}
DEFAULT_GPU_OVERHEAD = 600 * MiB   # CUDA context + cuBLAS workspace per GPU (docs/llamacpp.md section 6: 300-800 MiB)
HOST_PROCESS_OVERHEAD = 256 * MiB  # the process itself: code, tokenizer, small host buffers


@dataclass(frozen=True)
class DeviceMemory:
    weights: int = 0
    kv: int = 0
    compute: int = 0
    overhead: int = 0
    pool: int = 0       # ggml-cuda's memory pool: kernels' temporaries outside the logged buffers (ik: pool_bytes)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead + self.pool

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class MemoryReport:
    devices: dict[str, DeviceMemory]
    host_mapped: int = 0        # CPU weights served from the mmap'd file (page cache, evictable)
    host_pinned: int = 0        # CPU weights copied into pinned / anonymous memory (not evictable)
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        devs = sorted(self.devices, key=device_sort_key)
        return {"devices": {d: self.devices[d].to_dict() for d in devs},
                "host": {"mapped": self.host_mapped, "pinned": self.host_pinned}}

    def gpu_total(self, device: str) -> int:
        return self.devices.get(device, DeviceMemory()).total


# ---- where things are -----------------------------------------------------------------------------------------

def home_devices(inv: ModelInventory, plan: Plan) -> list[str]:
    """Device of each block's -ngl slot (KV, activations): the one rule flags/ renders -ngl/-ts from (the device of
    blk.N.attn_norm.weight); CPU for blocks with nothing allocated (NextN)."""
    from .flags.placement import home_devices as slot_homes
    return [h or "CPU" for h in slot_homes(plan.assignment, inv)[: inv.n_layer]]


def output_device(inv: ModelInventory, plan: Plan) -> str:
    name = "output_norm.weight" if inv.tied_output else "output.weight"
    return plan.assignment.get(name, "CPU")


# ---- weights ----------------------------------------------------------------------------------------------------

def weight_bytes(inv: ModelInventory, plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in inv.allocated():
        dev = plan.assignment.get(t.name, "CPU")
        out[dev] = out.get(dev, 0) + t.nbytes
    if inv.tied_output:   # token_embd is loaded a second time as the output, on the output's device
        dev = output_device(inv, plan)
        if dev != "CPU":
            out[dev] = out.get(dev, 0) + inv.by_name["token_embd.weight"].nbytes
    for dev, b in ik_wkv_b_bytes(inv, plan).items():
        out[dev] = out.get(dev, 0) + b
    return out


def ik_wkv_b_bytes(inv: ModelInventory, plan: Plan) -> dict[str, int]:
    """The attn_kv_b ik computes at load for -mla 0/2/3 from a GGUF that has only attn_k_b and attn_v_b (as
    mainline converts DeepSeek): [kv_lora_rank, n_head * (nope + v)], F16 / BF16 when both are, Q8_0 otherwise
    (src/llama.cpp:3411-3470, llm_compute_wkv_b :2892-2970), in a buffer of its own of attn_k_b's buffer type
    (anonymous memory, never mapped from the file), on attn_k_b's device; no buffer line logs it, only "Computed
    blk.N.attn_kv_b.weight as A x B of type T". 1.0 GiB for DeepSeek-V3."""
    if plan.dialect != "ik" or not inv.hparams.is_mla or ik_mla_plan(inv, plan).knobs.mla == 1:
        return {}
    out: dict[str, int] = {}
    for il in range(inv.n_layer):
        k_b, v_b = inv.by_name.get(f"blk.{il}.attn_k_b.weight"), inv.by_name.get(f"blk.{il}.attn_v_b.weight")
        if k_b is None or v_b is None or f"blk.{il}.attn_kv_b.weight" in inv.by_name:
            continue
        dk, dv = mla_head_dims(inv, il)
        types = {k_b.ggml_type, v_b.ggml_type}
        t = types.pop() if len(types) == 1 and types <= {"F16", "BF16"} else "Q8_0"
        dev = plan.assignment.get(k_b.name, "CPU")
        out[dev] = out.get(dev, 0) + inv.hparams.n_head * (dk - inv.hparams.n_rot + dv) * by_name(t).row_bytes(
            inv.hparams.mla_kv_lora_rank)
    return out


# ---- KV cache ---------------------------------------------------------------------------------------------------

def kv_cells(inv: ModelInventory, knobs: Knobs, il: int, dialect: str) -> int:
    """Cells of layer il's cache: n_ctx padded to 256; SWA layers (mainline) pad256(min(n_ctx, n_swa*n_seq + ub))."""
    hp = inv.hparams
    size = knobs.kv_size
    is_swa = il < len(hp.swa_layers) and hp.swa_layers[il] and hp.n_swa > 0
    if is_swa and dialect == "mainline" and not knobs.swa_full:
        swa = -(-min(size, hp.n_swa * knobs.n_seq + knobs.n_ubatch_eff) // 256) * 256
        return swa
    return size


def mla_head_dims(inv: ModelInventory, il: int) -> tuple[int, int]:
    """(K, V) head sizes of an MLA layer's decompressed attention (key_length_mla, value_length_mla: 192 and 128
    for DeepSeek-V3), from its attn_k_b [nope, kv_lora_rank, n_head] and attn_v_b [kv_lora_rank, v, n_head]."""
    k_b, v_b = inv.by_name.get(f"blk.{il}.attn_k_b.weight"), inv.by_name.get(f"blk.{il}.attn_v_b.weight")
    if k_b is None or v_b is None or len(k_b.shape) < 2 or len(v_b.shape) < 2:
        return 192, 128
    dv = v_b.shape[1] if len(v_b.shape) > 2 else v_b.shape[1] // inv.hparams.n_head   # ik's 2-D [kvl, n_head * v]
    return k_b.shape[0] + inv.hparams.n_rot, dv


def kv_layer_bytes(inv: ModelInventory, knobs: Knobs, il: int, dialect: str) -> int:
    hp = inv.hparams
    if il >= hp.n_layer - hp.n_nextn:
        return 0   # NextN layers get no cache (llama-model.cpp create_memory filter il < n_layer())
    n_kv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
    cells = kv_cells(inv, knobs, il, dialect)
    tk, tv = by_name(KV_TYPE[knobs.type_k]), by_name(KV_TYPE[knobs.type_v])
    if hp.is_mla and dialect == "ik" and knobs.mla and not knobs.flash_attn:
        # ik without flash attention (llama_model::cache_size): -mla 1 keeps c^KV (K type) and kv^T (V type, a
        # kv_lora_rank row per token); -mla 2/3 only c^KV, in the V type
        width = hp.mla_kv_lora_rank + hp.n_rot
        if knobs.mla == 1:
            return cells * tk.row_bytes(width) + tv.row_bytes(hp.mla_kv_lora_rank * cells)
        return cells * tv.row_bytes(width)
    if hp.is_mla and not (dialect == "ik" and knobs.mla == 0):
        # one K-only cache of kv_lora_rank + n_rot per token (the GGUF's key_length, head_count_kv 1)
        return cells * tk.row_bytes(hp.mla_kv_lora_rank + hp.n_rot)
    if hp.is_mla:   # ik -mla 0: the original attention, full K (nope + rope) and V for every head
        dk, dv = mla_head_dims(inv, il)
        return cells * (tk.row_bytes(hp.n_head * dk) + tv.row_bytes(hp.n_head * dv))
    return cells * (tk.row_bytes(n_kv * hp.head_dim_k) + tv.row_bytes(n_kv * hp.head_dim_v))


def ik_mla_plan(inv: ModelInventory, plan: Plan) -> Plan:
    """The plan with the -mla ik runs: an MLA model whose blocks are split between RAM and a GPU (0 < -ngl <
    n_layer) gets -mla 3 whatever was asked (ik 8337e4cd src/llama.cpp:8215-8224, which logs "changing mla to 3";
    a CPU build has already turned -ngl into 0). Other plans unchanged."""
    knobs = plan.knobs
    if plan.dialect != "ik" or not inv.hparams.is_mla or knobs.mla == 3:
        return plan
    from .flags.placement import home_devices as slot_homes
    blocks = slot_homes(plan.assignment, inv)[: inv.n_layer]
    if "CPU" in blocks and any(h not in (None, "CPU") for h in blocks):
        return dc_replace(plan, knobs=dc_replace(knobs, mla=3))
    return plan


def kv_bytes(inv: ModelInventory, plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    plan = ik_mla_plan(inv, plan)
    homes = home_devices(inv, plan)
    for il in range(inv.n_layer):
        dev = "CPU" if plan.knobs.no_kv_offload else homes[il]
        out[dev] = out.get(dev, 0) + kv_layer_bytes(inv, plan.knobs, il, plan.dialect)
    return out


# ---- compute buffers --------------------------------------------------------------------------------------------
#
# llama.cpp reserves each device's compute buffer by running ggml-alloc over the worst-case graphs (sched_reserve:
# the prompt graph of n_ubatch tokens and n_ubatch outputs, the one-token graph; the buffer keeps the larger).
# The buffer is the allocator's high-water mark, which its best-fit free list makes 0-40% larger than the largest
# set of tensors alive at once, so we rebuild the graph (planner/llama_graph.py) and replay the allocator
# (planner/ggml_graph.py) instead of summing live sets. The scheduler decides where each node runs
# (ggml-backend.cpp ggml_backend_sched_split_graph, passes 1-5), replicated in _assign below.

ALIGNMENT = {"CPU": 32}       # ggml-impl.h TENSOR_ALIGNMENT (CPU and CUDA_Host buffers)
GPU_ALIGNMENT = 128           # ggml-cuda.cu ggml_backend_cuda_buffer_type_get_alignment
_VIEW_OPS = frozenset({"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})


# ggml-cpu/repack.cpp ggml_repack_get_optimal_repack_type (~4925-5140): the weight types the CPU backend repacks
# into interleaved rows on the x86 hosts we run on, when the weight's rows (ne[1]) are a multiple of 8: Q4_0, Q4_K,
# IQ4_NL, MXFP4 with AVX2, Q2_K with AVX-512 (the GPU box's and CI's Xeons have both). Q8_0, Q5_K and Q6_K repack
# only on ARM / RISC-V builds. Its supports_op (~5190-5225) takes MUL_MAT on a 2-D and MUL_MAT_ID on a 3-D weight.
REPACK_TYPES = frozenset({"Q4_0", "Q4_K", "Q2_K", "IQ4_NL", "MXFP4"})
REPACK_ROWS = 8


def repacked(plan: Plan, tensor: Tensor) -> bool:
    """Whether mainline keeps this RAM-resident weight in the CPU_REPACK buffer. Only with --no-host: otherwise
    a GPU's pinned host buffer type comes first in the CPU weight list (llama-model.cpp make_cpu_buft_list
    ~1078-1130) and takes every weight. A repacked weight's buffer is not a host buffer, so the scheduler never
    offloads its op to a GPU (ggml-backend.cpp ~970: op offload needs ggml_backend_buffer_is_host)."""
    if plan.dialect != "mainline" or not plan.knobs.no_host or tensor.role == "token_embd":
        return False
    return (tensor.ggml_type in REPACK_TYPES and len(tensor.shape) in (2, 3)
            and tensor.shape[1] % REPACK_ROWS == 0)


def offload_min_batch(inv: ModelInventory, plan: Plan, tensor: Tensor, op: str | None = None) -> int | None:
    """Smallest batch at which the op on this RAM-resident weight runs on a GPU; None if it never does. `op`:
    the OffloadPolicy class when it is not the tensor's own (ik's MOE_FUSED_UP_GATE on up/gate experts).

    mainline: every MUL_MAT / MUL_MAT_ID with batch >= min_batch (GET_ROWS never). ik: the same, but MoE ops
    only once batch * n_expert_used >= min_batch * n_expert too (ggml-cuda.cu:5194-5210; docs/llamacpp.md
    section 4)."""
    if tensor.role == "token_embd" or len(tensor.shape) < 2:
        return None
    op = op or ("moe_matmul" if tensor.is_expert else ("output" if tensor.role == "output" else "dense_matmul"))
    rule = plan.knobs.offload.rule(op)
    if not rule.enabled or plan.knobs.rtr or repacked(plan, tensor):
        return None
    hp = inv.hparams
    if plan.dialect == "ik" and tensor.is_expert and hp.n_expert_used:
        mb = max(rule.min_batch, 1)
        return max(mb, -(-mb * hp.n_expert // hp.n_expert_used))
    return rule.min_batch


# ik ggml-cuda.cu ggml_backend_cuda_offload_op (:5180-5208): MUL_MAT_ID and MOE_FUSED_UP_GATE count their tokens in
# ne[2] (and must pass the n_expert condition, offload_min_batch), every other op but GET_ROWS in ne[1]
IK_OP_BATCH_DIM = {"MUL_MAT_ID": 2, "MOE_FUSED_UP_GATE": 2}
# an ik op on an expert weight whose -op rule is not MUL_MAT_ID's (planner/flags/ik.py CLASS_OPS)
IK_OP_CLASS = {"MOE_FUSED_UP_GATE": "moe_fused_up_gate"}


def _op_batch(node: GT, dialect: str = "mainline") -> int:
    """ggml-cuda.cu get_op_batch_size (ik: ggml_backend_cuda_offload_op): what the op-offload threshold compares
    with."""
    if node.op == "GET_ROWS":
        return 0
    if dialect == "ik":
        return node.ne[IK_OP_BATCH_DIM.get(node.op, 1)]
    if node.op == "MUL_MAT":
        return node.ne[1]
    if node.op in ("MUL_MAT_ID", "ROPE"):
        return node.ne[2]
    return node.ne[1] * node.ne[2] * node.ne[3]


def _offload_threshold(inv: ModelInventory, plan: Plan, weight: str, op: str = "") -> int | None:
    """Batch from which an op (ggml op name) on this host weight runs on the first GPU
    (ggml_backend_sched_backend_id_from_cur "1.off"); the output's duplicate of a tied token_embd counts as the
    output."""
    t = inv.by_name.get(weight)
    if t is None:
        return None
    if weight == TIED_OUTPUT or t.role == "output":
        rule = plan.knobs.offload.rule("output")
        # a tied output is token_embd loaded again for MUL_MAT: it repacks by its type like the output would
        out = t if t.role == "output" else dc_replace(t, role="output")
        return rule.min_batch if rule.enabled and not plan.knobs.rtr and not repacked(plan, out) else None
    if len(t.shape) < 2:      # norms and biases (MUL / ADD): offloaded like any op with a host weight
        rule = plan.knobs.offload.rule("dense_matmul")
        return rule.min_batch if rule.enabled and not plan.knobs.rtr else None
    return offload_min_batch(inv, plan, t, IK_OP_CLASS.get(op) if plan.dialect == "ik" else None)


# Runs of identical layers (same structure, same devices for every tensor) replay the same allocation pattern;
# once the allocator has gone through a few of them its free list repeats from layer to layer and the high-water
# mark stops moving. We build only the first KEEP_PERIODS periods of each run and its last period, which keeps
# the model's transitions (first/last layer, device boundaries, dense -> MoE) and makes planning fast on 61-layer
# models. tests/planner/test_memory.py checks it against the full graph on every preset.
KEEP_PERIODS = 3
_PERIODS = (1, 2, 4)          # dense/MoE runs; gpt-oss SWA/full alternation; llama4-style patterns


def _layer_signatures(inv: ModelInventory, plan: Plan, cells: tuple[int, ...]) -> list[tuple]:
    hp, homes = inv.hparams, home_devices(inv, plan)
    n = hp.n_layer - hp.n_nextn
    sigs = []
    for il in range(n):
        devs = tuple(plan.assignment.get(t.name, "CPU") for t in inv.by_layer.get(il, ()))
        swa = hp.swa_layers[il] if il < len(hp.swa_layers) else False
        moe = hp.moe_layers[il] if il < len(hp.moe_layers) else False
        # --no-host: which of the layer's RAM weights repack (and so never offload) depends on their types
        rp = tuple(repacked(plan, t) for t in inv.by_layer.get(il, ())) if plan.knobs.no_host else ()
        sigs.append((il == n - 1, moe, swa, cells[il], hp.n_head_kv[il], homes[il], devs, rp))
    return sigs


def kept_layers(sigs: list[tuple], keep_periods: int = KEEP_PERIODS) -> tuple[int, ...]:
    """Layer indices to build: every layer but the middle of long periodic runs of equal signatures."""
    n, i, keep = len(sigs), 0, []
    while i < n:
        best = None
        for p in _PERIODS:
            j = i + p
            while j < n and sigs[j] == sigs[j - p]:
                j += 1
            drop = (j - i - keep_periods * p - p) // p * p
            if drop > 0 and (best is None or drop > best[1]):
                best = (p, drop)
        if best is None:
            keep.append(i)
            i += 1
            continue
        p, drop = best
        keep.extend(range(i, i + keep_periods * p))
        i += keep_periods * p + drop
    return tuple(keep)


def _graph_params(inv: ModelInventory, plan: Plan, n_tokens: int, n_outputs: int,
                  layers: tuple[int, ...] | None, gpus: tuple[str, ...] = ()) -> GraphParams:
    knobs = plan.knobs
    cells = tuple(kv_cells(inv, knobs, il, plan.dialect) for il in range(inv.n_layer))
    hp = inv.hparams
    swa = [c for il, c in enumerate(cells) if il < len(hp.swa_layers) and hp.swa_layers[il]]
    ik_mla = {}
    if plan.dialect == "ik":
        ik_mla = dict(amb=knobs.amb)
        if hp.is_mla:
            # a plan with a GPU runs a GPU build, whose context has a GPU backend whatever -ngl says
            ik_mla.update(mla=knobs.mla, gpu_build=bool(gpus) or any(d != "CPU" for d in plan.assignment.values()))
    return GraphParams(n_tokens, n_outputs, knobs.flash_attn, knobs.type_k, knobs.type_v, cells,
                       swa_cells=swa[0] if swa else 0, base_cells=knobs.kv_size, layers=layers,
                       dialect=plan.dialect, fmoe=knobs.fmoe or plan.dialect != "ik", **ik_mla)


class _Memo:
    """A small LRU of pure results keyed by the inventory's identity (hashing a 1,000-tensor inventory on
    every call would cost more than the lookup saves) and a hashable key."""

    def __init__(self, size: int) -> None:
        self.size, self.items = size, OrderedDict()

    def get(self, inv: ModelInventory, key: tuple, make):
        k = (id(inv), key)
        hit = self.items.get(k)
        if hit is not None and hit[0] is inv:
            self.items.move_to_end(k)
            return hit[1]
        value = make()
        self.items[k] = (inv, value)
        if len(self.items) > self.size:
            self.items.popitem(last=False)
        return value


_GRAPHS = _Memo(32)       # GraphParams -> Compiled graph
_PEAKS = _Memo(256)       # (GraphParams, placement signature) -> peaks per device


def _graph(inv: ModelInventory, params: GraphParams) -> Compiled:
    return _GRAPHS.get(inv, (params,), lambda: Compiled(build_graph(inv, params)))


class _Devices:
    """Where weights and KV caches of a plan live, by the names the graph gives them; the GPUs the scheduler
    has (the plan's, plus those of the machine: op offload uses CUDA0 even when no weight lives there)."""

    def __init__(self, inv: ModelInventory, plan: Plan, gpus: tuple[str, ...] = ()) -> None:
        self.plan, self.homes, self.out = plan, home_devices(inv, plan), output_device(inv, plan)
        self.gpus = sorted({d for d in plan.assignment.values() if d != "CPU"} | set(gpus), key=device_sort_key)

    def of(self, ext: str) -> str:
        if ext.startswith("kv:"):
            return "CPU" if self.plan.knobs.no_kv_offload else self.homes[int(ext[3:])]
        if ext == TIED_OUTPUT:
            return self.out
        return self.plan.assignment.get(ext, "CPU")


def _assign(c: Compiled, inv: ModelInventory, plan: Plan, where: _Devices) -> list[str]:
    """Device of every tensor: the scheduler's passes 1, 2 and 4 (ggml-backend.cpp); externals where they live."""
    n = len(c.tensors)
    dev: list[str | None] = [None] * n
    kind, src, root, tensors = c.kind, c.src, c.root, c.tensors
    for i in range(n):
        if kind[i] == 2:
            dev[i] = where.of(tensors[i].ext)
    for i in c.leafs:
        dev[i] = "CPU"                                          # graph inputs: the last backend (CPU)
    gpu0 = where.gpus[0] if where.gpus else None
    for i in c.nodes:                                           # pass 1: pre-allocated sources and weights
        r = root[i]
        if r >= 0 and kind[r] == 2:
            dev[i] = dev[r]
            continue
        t = tensors[i]
        if t.op in ("ROPE", "FLASH_ATTN_EXT"):
            continue
        for s in src[i]:
            if kind[s] == 2 and not tensors[s].ext.startswith("kv:"):
                d = dev[s]
                if d == "CPU" and gpu0 is not None:
                    m = _offload_threshold(inv, plan, tensors[s].ext, t.op)
                    if m is not None and _op_batch(t, plan.dialect) >= m:
                        d = gpu0
                dev[i] = d
                break
    order = [i for i in c.nodes if not c.is_view_op[i]]
    for seq, skip_cpu in ((order, True), (order[::-1], True), (order, False), (order[::-1], False)):
        cur = None                                              # pass 2: expand gpu down/up, then the rest
        for i in seq:
            d = dev[i]
            if d is not None:
                cur = None if (skip_cpu and d == "CPU") else d
            elif cur is not None:
                dev[i] = cur
    fallback = gpu0 or "CPU"
    for i in c.nodes:                                           # pass 4: views follow their source
        if dev[i] is None:
            r = root[i]
            dev[i] = (dev[r] or fallback) if r >= 0 else fallback
    return dev


def _split(c: Compiled, dev: list[str], fusions: bool = True) -> tuple[list[int], list[tuple[int, ...]]]:
    """graph_copy of pass 5: at the start of each split, for every input from another device, a node that
    consumes the source (input_dep) and the source's copy in the split's buffer (one copy per tensor and
    device, reused by later splits); the split's nodes read the copy. A weight from another device also
    starts a new split, so that its copy is freed before the next one is made. Appends the new tensors to c
    (callers pass a private copy) and returns the node order and the rewired sources. fusions: the CUDA backend
    reorders and keeps tensors for its fusions (mainline; ik's backend has no graph_optimize hook)."""
    src = list(c.src)
    copies: dict[tuple[int, str], int] = {}
    order: list[int] = []
    pending: list[int] = []
    inputs: list[tuple[int, int]] = []
    kind, tensors = c.kind, c.tensors
    cur = None

    def keep_until(kept: list[int], dev_of: str) -> int:
        """A node that consumes `kept` (the scheduler's GGML_OP_NONE dependency node)."""
        i = c.add(GT("dep", (1,), "f32", "NONE", view_src=tensors[kept[0]], nbytes=0), tuple(kept), -1)
        dev.append(dev_of)
        src.append(tuple(kept))
        return i

    def flush() -> None:
        for s, cp in inputs:
            order.append(keep_until([s], dev[s]))
            order.append(cp)
        deps = _cuda_alloc_deps(c, pending, src) if fusions and cur is not None and cur != "CPU" else {}
        for i in pending:
            order.append(i)
            if i in deps:
                order.append(keep_until(deps[i], cur))
        pending.clear()
        inputs.clear()

    for i in c.nodes:
        if c.is_view_op[i]:
            pending.append(i)
            continue
        d = dev[i]
        new_split = d != cur
        if not new_split and inputs:
            new_split = any(kind[s] == 2 and not tensors[s].ext.startswith("kv:") and dev[s] != d for s in src[i])
        if new_split:
            flush()
            cur = d
        srcs = src[i]
        if any(dev[s] != d for s in srcs):
            rewired = []
            for s in srcs:
                if dev[s] == d:
                    rewired.append(s)
                    continue
                cp = copies.get((s, d))
                if cp is None:
                    t = tensors[s]
                    cp = c.add(GT(t.name + "#" + d, t.ne, t.dtype, "NONE", nbytes=t.nbytes), (), -1)
                    copies[(s, d)] = cp
                    dev.append(d)
                    src.append(())
                    inputs.append((s, cp))
                rewired.append(cp)
            src[i] = tuple(rewired)
        pending.append(i)
    flush()
    return order, src


_MAX_REDUCED_EXPERTS = 15     # ggml-cuda.cu MOE_WEIGHTED_REDUCTION_MAX_EXPERTS


def _cuda_alloc_deps(c: Compiled, split: list[int], src: list[tuple[int, ...]]) -> dict[int, list[int]]:
    """Tensors the CUDA backend keeps alive for fusions (ggml-cuda.cu ggml_backend_cuda_graph_optimize):
    {node: tensors kept until that node is allocated}. The MoE weighted reduction (MUL of the experts by their
    weights, then the views and ADDs over n_expert_used) keeps the experts and the weights to the last ADD,
    so the MUL cannot reuse the experts' memory; the top-k routing fusion keeps the router's tensors (and their
    sources) to its last node."""
    t, deps = c.tensors, {}
    n = len(split)
    ops = [t[i].op for i in split]
    for k, i in enumerate(split):
        op = ops[k]
        if op == "MUL":
            srcs = src[i]
            if len(srcs) == 2:
                ex, w = srcs
                A = t[i].ne[1]
                if t[ex].ne == t[i].ne and t[w].ne[0] == 1 and t[w].ne[1:] == t[i].ne[1:] \
                        and 2 <= A <= _MAX_REDUCED_EXPERTS and k + 2 * A <= n \
                        and all(ops[k + 1 + j] == "VIEW" for j in range(A)) \
                        and all(ops[k + 1 + A + j] == "ADD" for j in range(A - 1)):
                    deps.setdefault(split[k + 2 * A - 1], []).extend([ex, w])
        elif op in ("SOFT_MAX", "UNARY") and len(src[i]) == 1 and k + 5 < n:
            j = k + 1
            if ops[j] != "RESHAPE":
                continue
            j += 1
            if ops[j] == "ADD":                                  # exp_probs_b
                j += 1
            if ops[j:j + 3] != ["ARGSORT", "VIEW", "GET_ROWS"]:
                continue
            j += 3
            if ops[j:j + 5] == ["RESHAPE", "SUM_ROWS", "CLAMP", "DIV", "RESHAPE"]:
                j += 5
            if ops[j:j + 1] == ["SCALE"]:
                j += 1
            n_expert = t[i].ne[0]
            if n_expert & (n_expert - 1) and n_expert not in (288, 576) or n_expert > 576:
                continue
            last = j - 1
            kept = []
            for m in range(k, last):
                kept.append(split[m])
                kept.extend(src[split[m]])
            deps.setdefault(split[last], []).extend(kept)
    return deps


def _cuda_sizes(c: Compiled, dev: list[str], n_tokens: int) -> list[int]:
    """Allocation sizes on CUDA devices (ggml-cuda.cu ggml_backend_cuda_buffer_type_get_alloc_size): a flash
    attention node's allocation also holds F16 copies of K and V when the cache is not F16 and the kernel is
    the tile/MMA one (fattn.cu ggml_cuda_flash_attn_ext_get_alloc_size; the vector kernel, which handles
    quantized caches itself, only runs for <= 2 tokens). An MLA V that is a view of K shares K's copy."""
    sizes = c.nbytes
    for i, t in enumerate(c.tensors):
        if t.op != "FLASH_ATTN_EXT" or dev[i] == "CPU":
            continue
        q, k, v = (c.tensors[j] for j in c.src[i][:3])
        convert_k = k.dtype != "f16" and (n_tokens > 2 or k.dtype == "f32")
        convert_v = v.dtype != "f16" and (n_tokens > 2 or v.dtype == "f32")
        if not (convert_k or convert_v):
            continue
        if sizes is c.nbytes:
            sizes = list(c.nbytes)
        end = sizes[i]
        k_elems = k.ne[0] * k.ne[1] * k.ne[2] * k.ne[3]
        v_elems = v.ne[0] * v.ne[1] * v.ne[2] * v.ne[3]
        if convert_k:
            end = -(-end // 128) * 128 + 2 * k_elems
        if convert_v and not (v.view_src is not None and v.view_src is k.view_src):
            end = -(-end // 128) * 128 + 2 * v_elems
        sizes[i] = end
    return sizes


def _alignment(dev: str) -> int:
    return ALIGNMENT.get(dev, GPU_ALIGNMENT)


# ggml-backend.cpp GGML_SCHED_MAX_COPIES, the input copies with pipeline parallelism: ggml/CMakeLists.txt sets 4 in
# mainline and 1 in ik (8337e4cd), so ik's pipeline parallelism keeps one copy
SCHED_MAX_COPIES = {"mainline": 4, "ik": 1}


def pipeline_copies(inv: ModelInventory, plan: Plan) -> int:
    """How many copies of each graph input the scheduler keeps: SCHED_MAX_COPIES with pipeline parallelism, else 1.

    llama.cpp turns pipeline parallelism on (src/llama-context.cpp, `pipeline_parallel`; ik src/llama.cpp the same)
    when the model has several devices, every layer slot is offloaded (-ngl > n_layer), the split is by layer, the
    KV cache is offloaded and no tensor is overridden (no -ot, -cmoe, -ncmoe). The devices are the plan's GPUs up to
    the highest it uses (runtime/llamacpp.py restricts a run to them with -dev). Without overrides every tensor
    sits on its slot's device and the slots' GPUs ascend, as -ngl/-ts place them."""
    from .flags.common import base_assignment
    gpus = [gpu_index(d) for d in set(plan.assignment.values()) if d != "CPU"]
    copies = SCHED_MAX_COPIES.get(plan.dialect, 1)
    if copies <= 1 or not gpus or max(gpus) < 1 or plan.knobs.no_kv_offload:
        return 1
    slots = _slot_homes(inv, plan)
    if any(h is None or h == "CPU" for h in slots):
        return 1
    order = [gpu_index(h) for h in slots]
    if any(b < a for a, b in zip(order, order[1:])):
        return 1
    base = base_assignment(inv, slots)
    if any(plan.assignment.get(n, "CPU") != d for n, d in base.items()):
        return 1
    return copies


def _slot_homes(inv: ModelInventory, plan: Plan) -> list[str | None]:
    from .flags.placement import home_devices as slot_homes
    return slot_homes(plan.assignment, inv)


def _graph_peaks(inv: ModelInventory, plan: Plan, params: GraphParams, gpus: tuple[str, ...],
                 copies: int = 1) -> dict[str, int]:
    c = _graph(inv, params)
    if not gpus and not any(d != "CPU" for d in plan.assignment.values()):
        return allocate_compiled(c, c.leafs, c.nodes, ["CPU"] * len(c.tensors), _alignment)
    where = _Devices(inv, plan, gpus)
    dev = _assign(c, inv, plan, where)
    private = copy.copy(c)          # _split appends copy tensors: keep the cached graph intact
    for name in ("tensors", "src", "root", "kind", "layout", "inplace", "output", "is_view_op"):
        setattr(private, name, list(getattr(c, name)))
    # ik has no such rule (ik ggml-cuda.cu:754-765 sizes every tensor by its bytes): its F16 copies of a quantized
    # cache come from the CUDA pool (pool_bytes)
    private.nbytes = list(_cuda_sizes(c, dev, params.n_tokens) if plan.dialect != "ik" else c.nbytes)
    private.index = {}
    private._layouts = dict(c._layouts)
    n_before = len(private.tensors)
    order, src = _split(private, dev, fusions=plan.dialect != "ik")
    leafs = private.leafs
    if copies > 1:
        leafs = _pipeline_leafs(private, dev, src, n_before, copies)
    return allocate_compiled(private, leafs, order, dev, _alignment, src)


def _pipeline_leafs(c: Compiled, dev: list[str], src: list[tuple[int, ...]], n_before: int, copies: int) -> list[int]:
    """Pipeline parallelism (ggml-backend.cpp ggml_backend_sched_split_graph, passes 5-6 and graph_copy with
    n_copies > 1): every graph input and every split input gets `copies` copies, flagged input and output, so the
    allocator places them all first (as leafs) and never frees them; the graph reads copy 0. Appends the extra
    copies to c (a private copy) and returns the leaf order: input copies, then split-input copies, then the rest."""
    split_inputs = [i for i in range(n_before, len(c.tensors)) if c.kind[i] == 0]     # _split's copies
    graph_inputs = [i for i in c.leafs if c.kind[i] == 0]   # pass 6: graph inputs, on their backend (the CPU)
    first: list[int] = []
    for i in graph_inputs + split_inputs:               # pass 5: each split's inputs, n_copies of each
        c.output[i] = True
        first.append(i)
        t = c.tensors[i]
        for k in range(1, copies):
            j = c.add(GT(f"{t.name}#{k}", t.ne, t.dtype, "NONE", nbytes=t.nbytes), (), -1)
            dev.append(dev[i])
            src.append(())
            c.output[j] = True
            first.append(j)
    seen = set(first)
    return first + [i for i in c.leafs if i not in seen]


def compute_bytes(inv: ModelInventory, plan: Plan, reduce: bool = True, gpus: Sequence[str] = ()) -> dict[str, int]:
    """Per-device compute buffer: the larger of the prompt (n_ubatch tokens, n_ubatch outputs) and the
    one-token graph reservations, as sched_reserve makes them. gpus: the machine's GPUs ("CUDA0", ...) when
    they are more than the plan uses (with op offload, a plan with every weight in RAM still runs its prompt
    on CUDA0). reduce=False builds every layer (kept_layers gives the same result; tests check it)."""
    gpus = tuple(g for g in gpus if g != "CPU")
    plan = ik_mla_plan(inv, plan)
    knobs = plan.knobs
    T = knobs.n_ubatch_eff
    cells = tuple(kv_cells(inv, knobs, il, plan.dialect) for il in range(inv.n_layer))
    sigs = _layer_signatures(inv, plan, cells)
    layers = kept_layers(sigs) if reduce else None
    others = tuple(plan.assignment.get(t.name, "CPU") for t in inv.by_layer.get(None, ()))
    copies = pipeline_copies(inv, plan)
    placement = (tuple(sigs), others, knobs.offload, knobs.no_kv_offload, knobs.rtr, knobs.no_host, plan.dialect,
                 gpus, copies)
    out: dict[str, int] = {}
    # ik reserves the prompt graph only (src/llama.cpp:8628-8639: one llama_build_graph of min(n_ctx, n_ubatch)
    # tokens and as many outputs); mainline also the one-token graph
    graphs = [(plan, T, T), (plan, 1, 1)] if T > 1 and plan.dialect != "ik" else [(plan, T, T)]
    if plan.dialect == "ik" and not knobs.rtr:
        # ik applies -op after that reservation (src/llama.cpp:8672-8683; the scheduler starts with every op's
        # offload on, ggml-backend.cpp:2558): its buffers are sized with op offload on, and grow (ggml-alloc never
        # shrinks them) when a run with -op's ops on the CPU needs more
        every_op = OffloadPolicy(**{op: dc_replace(knobs.offload.rule(op), enabled=True) for op in OP_CLASSES})
        if every_op != knobs.offload:
            graphs.append((dc_replace(plan, knobs=dc_replace(knobs, offload=every_op)), T, T))
    for pl, n_tokens, n_outputs in graphs:
        params = _graph_params(inv, pl, n_tokens, n_outputs, layers, gpus)
        key = (params, (*placement[:2], pl.knobs.offload, *placement[3:]))
        peaks = _PEAKS.get(inv, key, lambda: _graph_peaks(inv, pl, params, gpus, copies))  # noqa: B023
        for d, b in peaks.items():
            out[d] = max(out.get(d, 0), b)
    return out


# ---- the CUDA memory pool (ik) ----------------------------------------------------------------------------------
#
# Kernels take their temporaries from a per-device pool that no buffer line logs (ik 8337e4cd ggml-cuda.cu:426-521:
# on a GPU with virtual memory management it maps physical memory in granularity steps as the high-water mark of its
# stack rises, and never unmaps it). Requests are freed in reverse order within the op that made them, so the pool
# ends as large as the largest set of temporaries one op held at once, over every op and batch the device ran.
# Two kinds of op set it:
#
# - flash attention (GQA models): sized in launch_fattn_mma (ggml-cuda/fattn-mma-f16.cuh:1269-1432): F16 copies of
#   K and V unless the cache is F16, the KV_min_max table from 1024 tokens, and dst_tmp_meta. That last one is
#   allocated as blocks * ncols * (4 + D) * sizeof(float) elements of float2 (fattn-mma-f16.cuh:1389), and on a batch
#   that fills its waves well (>= 75 %, up to 2048 tokens) ik launches one block per tile instead of 2 per SM
#   (fattn-mma-f16.cuh:1372-1385): 264 MiB at 2048 tokens for Qwen3-30B-A3B's 32 heads of 128, 66 MiB at 512.
#   Mainline always takes the stream-k path on Ada and newer, with a block count bounded by the SMs.
# - the MoE ops (MOE_FUSED_UP_GATE, MUL_MAT_ID) on the GPU that runs them: the experts' GPU, or the first GPU when
#   op offload uploads RAM-resident experts for the batch. Their q8_1 activations, row ids and F32 up/gate results
#   grow with tokens x n_expert_used (_ik_moe_op_pool): 272.5 MiB at 4096 tokens for Qwen3-30B-A3B, where the
#   attention is back to 68.
#
# Mainline's pool is part of the overhead its profiles were calibrated on, so both terms are ik's. docs/ik_llama.md
# has the derivations and the H100 numbers.

VMM_GRANULARITY = 2 * MiB     # cuMemGetAllocationGranularity(RECOMMENDED) on NVIDIA GPUs
POOL_ALIGNMENT = 128          # ggml_cuda_pool_vmm::alloc rounds every request to 128 bytes
FATTN_KQ_STRIDE = 256         # ggml-cuda/fattn-common.cuh
DEFAULT_N_SM = 128            # SMs of a GPU whose profile does not say (an RTX 4090's)


def _pool_round(n: int) -> int:
    return -(-n // POOL_ALIGNMENT) * POOL_ALIGNMENT


def _ik_fattn_pool(n_tokens: int, head_dim: int, n_head: int, n_head_kv: int, cells: int, n_swa: int,
                   convert_k: bool, convert_v: bool, n_sm: int) -> int:
    """Pool bytes ik's MMA flash attention holds at once for a batch of n_tokens (ggml-cuda/fattn.cu:34-172,
    fattn-mma-f16.cu:152-260, fattn-mma-f16.cuh:1269-1432)."""
    gqa = n_head // n_head_kv
    ncols2 = next(c for c in (8, 4, 2, 1) if gqa % c == 0)          # the GQA-optimised kernels (mask, no ALiBi)
    ncols1 = next((c // ncols2 for c in (8, 16, 32) if n_tokens <= c // ncols2), 64 // ncols2)
    ncols = ncols1 * ncols2
    n_kv = cells
    if n_swa > 0:                                                   # fattn.cu:53-71: only the window is attended
        window = FATTN_KQ_STRIDE * (-(-(max(FATTN_KQ_STRIDE, n_tokens) + n_swa) // FATTN_KQ_STRIDE))
        n_kv = min(cells, window)
    used = 0
    if convert_k:
        used += _pool_round(2 * head_dim * n_kv * n_head_kv)
    if convert_v:
        used += _pool_round(2 * head_dim * n_kv * n_head_kv)
    ntiles_x = -(-n_tokens // ncols1)
    if n_tokens >= 1024:                                            # KV_min_max: one int2 per tile row
        used += _pool_round(8 * ntiles_x)
    ntiles_total = ntiles_x * (n_head // ncols2)
    max_blocks = 2 * n_sm if n_tokens > 1 else n_sm
    nwaves = -(-ntiles_total // max_blocks)
    efficiency = 100 * ntiles_total // (max_blocks * nwaves)
    blocks = max_blocks if efficiency < 75 or n_tokens > 2048 else ntiles_total
    used += _pool_round(blocks * ncols * (4 + head_dim) * 4 * 8)
    return used


def _granular(n: int) -> int:
    return -(-n // VMM_GRANULARITY) * VMM_GRANULARITY


Batches = int | tuple[int, ...]   # the batch sizes a run decodes: n means every size 1..n (a server); or a tuple


def _sizes(batches: Batches) -> Sequence[int]:
    return range(1, batches + 1) if isinstance(batches, int) else batches


@functools.lru_cache(maxsize=256)
def _ik_fattn_peak(batches: Batches, head_dim: int, n_head: int, n_head_kv: int, cells: int, n_swa: int,
                   convert_k: bool, convert_v: bool, n_sm: int) -> int:
    return _granular(max((_ik_fattn_pool(b, head_dim, n_head, n_head_kv, cells, n_swa, convert_k, convert_v, n_sm)
                          for b in _sizes(batches)), default=0))


def ik_fattn_pool_bytes(max_tokens: int, head_dim: int, n_head: int, n_head_kv: int, cells: int, n_swa: int = 0,
                        convert_k: bool = False, convert_v: bool = False, n_sm: int = DEFAULT_N_SM) -> int:
    """The pool ik's flash attention grows to over batches of 1..max_tokens tokens (a server sees every size up
    to the ubatch), rounded to the VMM granularity. Not monotonic: past 2048 tokens, or on a poorly filled last
    wave, the kernel falls back to 2 blocks per SM and the temporary shrinks."""
    return _ik_fattn_peak(max_tokens, head_dim, n_head, n_head_kv, cells, n_swa, convert_k,
                          convert_v, n_sm)


# The MoE ops. ik 8337e4cd, GPUs with int8 tensor cores (Turing and newer; older ones and AMD pick other kernels).
# Quantized experts of an MMQ type (ggml-cuda/mmq.cu:185-228, the same list as mmq_id.cu:499-545) take the grouped
# MMQ path while tokens <= mmq_id_thresh * n_expert (ggml-cuda.cu:2906, :3210); otherwise, or for other types, the
# older per-expert loop (ggml-cuda.cu:2911-3030, :3310-3536).
MMQ_TYPES = frozenset({
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_0", "Q8_0", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS",
    "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_S_R4", "IQ4_XS", "IQ4_NL", "IQ2_KS", "IQ2_KL", "IQ2_K",
    "IQ2_K_R4", "IQ3_KS", "IQ3_K", "IQ3_K_R4", "IQ4_KSS", "IQ4_KS", "IQ4_KS_R4", "IQ4_K", "IQ4_K_R4", "IQ5_KS",
    "IQ5_KS_R4", "IQ5_K", "IQ5_K_R4", "IQ6_K", "IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT"})
MMQ_ID_THRESH = 32            # ggml-cuda/common.cuh:857 (-cuda mmq-id-thresh=N changes it)
MMVQ_MAX_BATCH_SIZE = 8       # ggml-cuda/mmvq.cuh:10
MATRIX_ROW_PADDING = 512      # ggml-cuda/common.cuh:63: q8_1 rows are padded to it
MMQ_X_MAX = 128               # mmq.cuh:131 get_mmq_x_max_host with int8 MMA
MMQ_Y = 128                   # mmq.cuh:160 get_mmq_y_host (NVIDIA from Volta)
Q8_1_MMQ_BLOCK = 144          # sizeof(block_q8_1_mmq), 128 values (mmq.cuh:32-53)


def _q8_1(rows: int, ne10: int, mmq: bool = True) -> int:
    """A pool request for `rows` rows of ne10 F32 values quantized to q8_1 (36 bytes per 32, rows padded to
    MATRIX_ROW_PADDING); the MMQ layout asks for MMQ_X_MAX extra blocks (mmq_id.cu:459-460, ggml-cuda.cu:3225-3226)."""
    n = rows * (-(-ne10 // MATRIX_ROW_PADDING) * MATRIX_ROW_PADDING) // 32 * 36
    return _pool_round(n + (MMQ_X_MAX * Q8_1_MMQ_BLOCK if mmq else 0))


def _mmq_fixup(n_cols: int, nrows_x: int, nchannels: int, n_sm: int) -> int:
    """The stream-k fixup buffer of an MMQ-id launch (mmq_id_common.cuh:4010-4016): nsm * mmq_x * mmq_y floats
    unless the tiles divide evenly among the SMs; mmq_x is the smallest tile width with the fewest column tiles
    (mmq_id_common.cuh:4067-4083, granularity 16 from 48 columns)."""
    best, tiles = 0, n_cols + 1
    for x in range(8, MMQ_X_MAX + 1, 8):
        if tiles <= 1:
            break
        if x >= 48 and x % 16:
            continue
        t = -(-n_cols // x)
        if t < tiles:
            best, tiles = x, t
    nty = -(-nrows_x // MMQ_Y)
    return 0 if tiles * nty * nchannels % n_sm == 0 else _pool_round(n_sm * best * MMQ_Y * 4)


@dataclass(frozen=True)
class MoeShape:
    """One layer's routed experts as the MoE ops see them: up/gate rows (n_ff; merged: 2 * n_ff) from n_embd."""
    n_embd: int
    n_ff: int
    n_expert: int
    n_expert_used: int
    merged: bool              # one ffn_gate_up_exps tensor (ik -muge / merged GGUFs): src0_2 is null
    mmq_up: bool              # up/gate experts of an MMQ type
    mmq_down: bool


def _ik_moe_op_pool(op: str, b: int, m: MoeShape, n_sm: int) -> int:
    """Pool bytes one MoE op holds at once for a batch of b tokens. op: "fused" (MOE_FUSED_UP_GATE with the
    down projection next on the same GPU, which it runs itself when it can and which follows it otherwise),
    "fused_alone" (the down runs elsewhere), "up" (MUL_MAT_ID of up or gate), "down" (MUL_MAT_ID of the down
    projection)."""
    E, U, R = m.n_expert, m.n_expert_used, b * m.n_expert_used
    rows_ug = 2 * m.n_ff if m.merged else m.n_ff
    f32 = _pool_round
    fused = op in ("fused", "fused_alone")
    mmq = m.mmq_down if op == "down" else m.mmq_up
    # the down projection after a fused up/gate that cannot run it (not an MMQ type): its own MUL_MAT_ID
    after = _ik_moe_op_pool("down", b, m, n_sm) if op == "fused" and not m.mmq_down else 0
    if fused and b <= MMVQ_MAX_BATCH_SIZE and mmq:
        # ggml-cuda.cu:3045-3140: token generation, q8_1 of the tokens and, fused, of the up/gate result
        return max(after, _q8_1(b, m.n_embd, False) + (_q8_1(R, m.n_ff, False) if op == "fused" and m.mmq_down
                                                        else 0))
    if not fused and b == 1 and mmq and (op == "up" or U <= MMVQ_MAX_BATCH_SIZE):
        return _q8_1(1 if op == "up" else U, m.n_embd if op == "up" else m.n_ff, False)  # ggml-cuda.cu:2843-2874
    grouped = mmq and b <= MMQ_ID_THRESH * E
    if fused and grouped:
        # ggml-cuda.cu:3215-3227: row ids (ids_src1, ids_dst, expert_bounds in one request) and the tokens' q8_1
        # rows, one per (token, expert); :3235-3236 / :3270-3271 the F32 up and gate results (merged: up_gate at
        # twice the width and an unused gate buffer); their MMQ launches take the stream-k fixup
        base = f32(4 * (2 * R + E + 1)) + _q8_1(R, m.n_embd)
        dst = f32(8 * R * m.n_ff) + f32(4 * R * m.n_ff) if m.merged else 2 * f32(4 * R * m.n_ff)
        peak = base + dst + _mmq_fixup(b, rows_ug, E, n_sm)
        if op == "fused" and m.mmq_down:
            # :3300-3304: the down projection while ids and q8_1 are still held (the F32 results are freed):
            # mmq_id.cu:398-413 its own row ids, :459-470 q8_1 of the up/gate product
            down = f32(4 * R) * 2 + f32(4 * (E + 1)) + _q8_1(R, m.n_ff) + _mmq_fixup(b, m.n_embd, E, n_sm)
            peak = max(peak, base + down)
        return max(peak, after)
    if fused:
        # ggml-cuda.cu:3352-3388: q8_1 (or an F32 copy) of the tokens, the F32 up and gate results, the fused
        # down's result (asked for in bytes of its element count, :3379), the row mapping; then per expert (at
        # most b rows) the MMQ fixup and the down projection's q8_1 input (:3508-3510 -> mmq_id.cu:370-376)
        held = (_q8_1(b, m.n_embd) if mmq else f32(4 * b * m.n_embd)) + f32(8 * R)
        held += f32(8 * R * m.n_ff) + f32(4 * R * m.n_ff) if m.merged else 2 * f32(4 * R * m.n_ff)
        per_expert = _mmq_fixup(b, rows_ug, 1, n_sm) if mmq else 0
        if op == "fused":
            held += _pool_round(R * m.n_embd)
            if m.mmq_down:
                per_expert = max(per_expert, _q8_1(b, m.n_ff) + _mmq_fixup(b, m.n_embd, 1, n_sm))
        return held + per_expert
    ne10, ne01 = (m.n_embd, rows_ug) if op == "up" else (m.n_ff, m.n_embd)
    if grouped:
        # ggml-cuda.cu:2906-2909 -> mmq_id.cu:398-413 row ids, :459-470 q8_1 of (token, expert) rows, the fixup
        return f32(4 * R) * 2 + f32(4 * (E + 1)) + _q8_1(R, ne10) + _mmq_fixup(b, ne01, E, n_sm)
    # ggml-cuda.cu:2944-2952: the row mapping, F32 copies of src1 (the tokens once for up/gate, one row per
    # (token, expert) for down) and of dst; per expert (at most b rows) q8_1 of its rows and the fixup (:2990-3002)
    src1 = b * ne10 if op == "up" else R * ne10
    held = f32(8 * R) + f32(4 * src1) + f32(4 * R * ne01)
    return held + (_q8_1(b, ne10) + _mmq_fixup(b, ne01, 1, n_sm) if mmq else 0)


NO_LIMIT = 1 << 62


@functools.lru_cache(maxsize=1024)
def _ik_moe_peak(batches: Batches, ops: tuple[tuple[str, int, int], ...], m: MoeShape, n_sm: int) -> int:
    """The most pool bytes any of `ops` (op, batches lo <= b < hi at which this GPU runs it) holds over
    `batches`."""
    return max((_ik_moe_op_pool(op, b, m, n_sm) for op, lo, hi in ops for b in _sizes(batches) if lo <= b < hi),
               default=0)


def _moe_layers(inv: ModelInventory) -> list[tuple[int, dict[str, Tensor]]]:
    out = []
    for il in inv.moe_layers():
        ts = {t.role: t for t in inv.by_layer.get(il, ()) if t.is_expert}
        if "exps_down" in ts and ("exps_gate_up" in ts or {"exps_up", "exps_gate"} <= ts.keys()):
            out.append((il, ts))
    return out


def ik_fuses_up_gate(plan: Plan, up: Tensor, gate: Tensor | None) -> bool:
    """Whether ik runs this layer's up and gate experts as one MOE_FUSED_UP_GATE (llama-build-context.cpp:1583-1609):
    a merged gate_up tensor (gate None) always, separate ones with -fmoe (ik's default) when of one type. The op
    runs where the up experts are (ggml-backend.cpp:1340-1360, its first weight source), and a gate elsewhere is
    copied into that device's compute buffer for every batch."""
    return plan.dialect == "ik" and (gate is None or (plan.knobs.fmoe and up.ggml_type == gate.ggml_type))


def _moe_op_device(inv: ModelInventory, plan: Plan, gpu0: str | None, t: Tensor, op_class: str
                   ) -> tuple[str | None, int]:
    """(GPU, smallest batch) on which the MoE op on expert tensor t runs; (None, 0) if only on the CPU."""
    dev = plan.assignment.get(t.name, "CPU")
    if dev != "CPU":
        return dev, 1
    lo = offload_min_batch(inv, plan, t, op_class) if gpu0 is not None else None
    return (gpu0, lo) if lo is not None else (None, 0)


def _ik_moe_ops(inv: ModelInventory, plan: Plan, gpu0: str | None) -> list[tuple[str, MoeShape, tuple]]:
    """Per GPU, the MoE ops it runs in each layer, with the smallest batch from which it runs them there: 1 for
    experts in its VRAM; for experts in RAM on the first GPU, the batch from which ik offloads the op
    (ggml-cuda.cu:5194-5210: batch >= min_batch and batch * n_expert_used >= min_batch * n_expert), if its
    OffloadPolicy rule is on (-op) and -rtr is off. With -fmoe (knobs.fmoe) and up and gate of one type ik builds
    MOE_FUSED_UP_GATE (llama-build-context.cpp:1583-1609), which runs the down projection itself when it is the
    next node on the same GPU (ggml-cuda.cu:3300, :3343); a merged gate_up tensor is always fused."""
    hp = inv.hparams
    out = []
    for _, ts in _moe_layers(inv):
        down = ts["exps_down"]
        merged = "exps_gate_up" in ts
        up = ts["exps_gate_up"] if merged else ts["exps_up"]
        n_ff = up.shape[1] // 2 if merged else up.shape[1]
        n_expert = up.shape[2] if len(up.shape) > 2 else hp.n_expert
        used = hp.n_expert_used
        if used <= 0 or n_expert <= 0:
            continue
        m = MoeShape(up.shape[0], n_ff, n_expert, used, merged, up.ggml_type in MMQ_TYPES,
                     down.ggml_type in MMQ_TYPES)
        where = functools.partial(_moe_op_device, inv, plan, gpu0)
        d_dev, d_lo = where(down, "moe_matmul")
        fused = ik_fuses_up_gate(plan, up, None if merged else ts["exps_gate"])
        if not fused:
            for t in (ts["exps_up"], ts["exps_gate"]):
                dev, lo = where(t, "moe_matmul")
                if dev is not None:
                    out.append((dev, m, (("up", lo, NO_LIMIT),)))
            if d_dev is not None:
                out.append((d_dev, m, (("down", d_lo, NO_LIMIT),)))
            continue
        u_dev, u_lo = where(up, "moe_fused_up_gate")
        if u_dev is not None and u_dev == d_dev:
            # both on this GPU from max(u_lo, d_lo); below that only the one whose threshold is lower
            both = max(u_lo, d_lo)
            out.append((u_dev, m, (("fused", both, NO_LIMIT), ("fused_alone", u_lo, both), ("down", d_lo, both))))
            continue
        if u_dev is not None:
            out.append((u_dev, m, (("fused_alone", u_lo, NO_LIMIT),)))
        if d_dev is not None:
            out.append((d_dev, m, (("down", d_lo, NO_LIMIT),)))
    return out


def pool_bytes(inv: ModelInventory, plan: Plan, hw: HardwareProfile | None = None,
               batches: Sequence[int] | None = None) -> dict[str, int]:
    """Per GPU, the CUDA pool the plan's run keeps (ik dialect): the largest set of temporaries one op holds, over
    the attention of the layers whose KV the GPU holds (flash attention) and the MoE ops it runs, rounded to the
    VMM granularity. batches: the batch sizes the run decodes; default every size from 1 to the ubatch, as a
    server sees (llama-sweep-bench runs only the ubatch and single tokens). Not modelled (0): mainline (its pool
    peaks are part of the calibrated overhead), ik's attention without flash attention, MLA and K/V head sizes
    that differ (other kernels), and the smaller temporaries of the other ops."""
    knobs, hp = plan.knobs, inv.hparams
    if plan.dialect != "ik":
        return {}
    sizes: Batches = tuple(sorted({b for b in batches if 1 <= b <= knobs.n_ubatch_eff})) if batches is not None \
        else knobs.n_ubatch_eff

    def sms(dev: str) -> int:
        if hw is not None and gpu_index(dev) < len(hw.gpus) and hw.gpu(dev).n_sm > 0:
            return hw.gpu(dev).n_sm
        return DEFAULT_N_SM

    out: dict[str, int] = {}
    if knobs.flash_attn and not knobs.no_kv_offload and not hp.is_mla and hp.head_dim_k == hp.head_dim_v:
        homes = home_devices(inv, plan)
        for il in range(hp.n_layer - hp.n_nextn):
            dev = homes[il]
            n_head_kv = hp.n_head_kv[il] if il < len(hp.n_head_kv) else hp.n_head_kv[-1]
            if dev == "CPU" or n_head_kv <= 0:
                continue
            swa = hp.n_swa if il < len(hp.swa_layers) and hp.swa_layers[il] else 0
            b = _ik_fattn_peak(sizes, hp.head_dim_k, hp.n_head, n_head_kv, kv_cells(inv, knobs, il, plan.dialect),
                               swa, knobs.type_k != "f16", knobs.type_v != "f16", sms(dev))
            out[dev] = max(out.get(dev, 0), b)
    gpus = sorted({d for d in plan.assignment.values() if d != "CPU"}, key=device_sort_key)
    for dev, m, ops in dict.fromkeys(_ik_moe_ops(inv, plan, gpus[0] if gpus else None)):
        b = _granular(_ik_moe_peak(sizes, ops, m, sms(dev)))
        if b:
            out[dev] = max(out.get(dev, 0), b)
    return out


# ---- everything -------------------------------------------------------------------------------------------------

def estimate(inv: ModelInventory, plan: Plan, hw: HardwareProfile | None = None) -> MemoryReport:
    # GPUs the plan leaves empty are not passed to compute_bytes: with op offload llama.cpp would still run the
    # prompt there (-ngl 0 on a GPU box reserves a CUDA0 compute buffer), but a plan without GPU tensors is
    # rendered and budgeted as a CPU-only run by propose.py.
    w, kv, comp = weight_bytes(inv, plan), kv_bytes(inv, plan), compute_bytes(inv, plan)
    pool = pool_bytes(inv, plan, hw)
    devices = sorted(set(w) | set(kv) | set(comp) | set(pool) | {"CPU"}, key=device_sort_key)
    out = {}
    for d in devices:
        if d == "CPU":
            overhead = HOST_PROCESS_OVERHEAD
        elif hw is not None and gpu_index(d) < len(hw.gpus):
            overhead = hw.gpu(d).overhead_bytes
        else:
            overhead = DEFAULT_GPU_OVERHEAD
        out[d] = DeviceMemory(w.get(d, 0), kv.get(d, 0), comp.get(d, 0), overhead, pool.get(d, 0))
    cpu_w = w.get("CPU", 0)
    # CPU weights are mmap'd (page cache) unless mmap is off. ik too: tensors an -ot sends to RAM land in its
    # default host buffer type, which ik maps from the file like the plain CPU one (ik 8337e4cd src/llama.cpp
    # ~4735: `buft == llama_default_buffer_type_cpu(true) || buft == ggml_backend_cpu_buffer_type()`); -rtr turns
    # mmap off (Knobs.mmap False).
    # mainline --no-host: the weights the CPU backend repacks are copied into its CPU_REPACK buffer (anonymous
    # memory, whatever mmap says; llama-model.cpp only maps the default CPU buffer type) and the rest stay mapped.
    pinned = not plan.knobs.mmap
    if pinned:
        return MemoryReport(out, host_mapped=0, host_pinned=cpu_w)
    anon = 0 if not plan.knobs.no_host else min(cpu_w, sum(
        t.nbytes for t in inv.allocated() if plan.assignment.get(t.name, "CPU") == "CPU" and repacked(plan, t)))
    anon += ik_wkv_b_bytes(inv, plan).get("CPU", 0)        # computed at load: never mapped
    return MemoryReport(out, host_mapped=cpu_w - anon, host_pinned=anon)
