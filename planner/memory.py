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

ik's GPUs also hold its CUDA pool (planner/ik_pool.py): the temporaries of its flash attention and of its MoE ops,
which grow with the ubatch and appear in no buffer line ik logs. Where each block, the output and an op on a
RAM-resident weight run, and a layer's KV cells: planner/residency.py.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import asdict, dataclass, field, replace as dc_replace
from collections.abc import Sequence

from .ggml_graph import GT, Compiled, allocate_compiled
from .ggml_types import by_name
from .hardware import MiB, HardwareProfile
from .ik_pool import pool_bytes
from .llama_graph import TIED_OUTPUT, GraphParams, build_graph
from .model import ModelInventory
from .plan import OP_CLASSES, Knobs, OffloadPolicy, Plan, device_sort_key, gpu_index
from .residency import home_devices, kv_cells, offload_min_batch, output_device, repacked

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
                if (t[ex].ne == t[i].ne and t[w].ne[0] == 1 and t[w].ne[1:] == t[i].ne[1:]
                        and 2 <= A <= _MAX_REDUCED_EXPERTS and k + 2 * A <= n
                        and all(ops[k + 1 + j] == "VIEW" for j in range(A))
                        and all(ops[k + 1 + A + j] == "ADD" for j in range(A - 1))):
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
