"""Where a plan puts what its tensor assignment does not name: each block's home device (where its KV cache and
activations live), the output's device, a layer's KV cells, whether mainline repacks a RAM-resident weight, and
from which batch an op on a RAM-resident weight runs on a GPU (op offload). The memory model (memory.py, ik_pool.py),
the cost model (cost.py) and the torch engine read these; facts: docs/llamacpp.md sections 2, 4, 5 and 11.
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import ModelInventory, Tensor
from .plan import Knobs, Plan, device_sort_key


# ---- where things are -----------------------------------------------------------------------------------------

def home_devices(inv: ModelInventory, plan: Plan) -> list[str]:
    """Device of each block's -ngl slot (KV, activations): the one rule flags/ renders -ngl/-ts from (the device of
    blk.N.attn_norm.weight); CPU for blocks with nothing allocated (NextN)."""
    from .flags.placement import home_devices as slot_homes
    return [h or "CPU" for h in slot_homes(plan.assignment, inv)[: inv.n_layer]]


def output_device(inv: ModelInventory, plan: Plan) -> str:
    name = "output_norm.weight" if inv.tied_output else "output.weight"
    return plan.assignment.get(name, "CPU")


def gpu_shares(inv: ModelInventory, plan: Plan) -> dict[str, GpuShare]:
    """Per GPU: the blocks homed on it (their KV cache with them), the routed-expert and other weight bytes it holds,
    and whether it holds the output layer: the choices a several-GPU plan makes, as a report names them."""
    homes = home_devices(inv, plan)
    out = output_device(inv, plan)
    by_name = {t.name: t for t in inv.allocated()}
    shares: dict[str, GpuShare] = {}
    for name, dev in plan.assignment.items():
        t = by_name.get(name)
        if t is None or dev == "CPU":
            continue
        s = shares.setdefault(dev, GpuShare(dev))
        if t.is_expert:
            s.expert_bytes += t.nbytes
        else:
            s.other_bytes += t.nbytes
    for dev in set(homes) - {"CPU"}:
        shares.setdefault(dev, GpuShare(dev))
    for s in shares.values():
        s.layers = homes.count(s.device)
        s.output = out == s.device
    return {d: shares[d] for d in sorted(shares, key=device_sort_key)}


@dataclass
class GpuShare:
    device: str
    layers: int = 0
    expert_bytes: int = 0
    other_bytes: int = 0
    output: bool = False

    def words(self) -> str:
        """`CUDA1: 47 layers, 20.1 GiB of experts, the output layer`."""
        parts = [f"{self.layers} layer{'s' if self.layers != 1 else ''}"]
        if self.expert_bytes:
            parts.append(f"{self.expert_bytes / 2 ** 30:.1f} GiB of experts")
        if self.output:
            parts.append("the output layer")
        return f"{self.device}: {', '.join(parts)}"


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


# ---- repacking and op offload -----------------------------------------------------------------------------------

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
