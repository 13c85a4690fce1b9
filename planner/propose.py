"""Placement strategies and filling the GPUs' room: turn (model, hardware, knobs) into candidate Plans.

Every strategy starts from *homes* (the -ngl slot device of each layer and of the output layer) and then
places expert tensors: all on the CPU, or filled onto the GPUs by predicted benefit per byte. Non-expert
weights (attention, norms, router, shared experts, dense FFN) always follow their layer's home: per byte they
save more decode time than routed experts (a token reads all of them, but only n_expert_used / n_expert of
an expert tensor), so they go to the GPU first.

A plan's room is per GPU: the GPU's memory (--gpu) minus what is kept free (--keep-free) and the memory model's
margin; the memory model (planner/memory.py) is the judge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal
from collections.abc import Callable, Iterable

from .errors import BudgetError
from .hardware import MiB, HardwareProfile, fmt_bytes
from .host import HostBill
from .ik_pool import ik_fuses_up_gate
from .memory import DeviceMemory, MemoryReport, estimate
from .model import ModelInventory
from .plan import Dialect, Knobs, Plan, gpu_names

Order = Literal["first", "last", "spread"]
ORDERS: tuple[str, ...] = ("first", "last", "spread")
DEFAULT_MARGIN = 512 * MiB
# Within a partial layer, which expert tensor goes to the GPU first (ffn_down first: it is the one
# llama.cpp's --fit moves last to the CPU, and its row length is n_ff_exp, the cheapest to split).
PARTIAL_ORDER = ("exps_down", "exps_up", "exps_gate", "exps_gate_up")


def model_id(inv: ModelInventory) -> str:
    return inv.source or inv.name


@dataclass(frozen=True)
class Room:
    """What a plan may use: per GPU its memory (GPU.vram_bytes, the --gpu size) minus what is kept free
    (hw.keep_free_bytes, --keep-free) and minus `margin` (the memory model's allowance for its own error); on the
    CPU, host RAM. (The word "budget" in printed and stored text, "over budget", means this room.)"""
    gpus: dict[str, int]
    host: int

    @classmethod
    def from_hardware(cls, hw: HardwareProfile, margin: int = DEFAULT_MARGIN) -> Room:
        return cls({d: g.vram_bytes - hw.keep_free_bytes - margin for d, g in zip(gpu_names(len(hw.gpus)), hw.gpus)},
                   hw.host.ram_bytes)

    def fits(self, report: MemoryReport) -> bool:
        for dev, mem in report.devices.items():
            if dev == "CPU":
                if report.host_pinned + mem.kv + mem.compute + mem.overhead > self.host:
                    return False
            elif mem.total > self.gpus.get(dev, 0):
                return False
        return True


# ---- homes --------------------------------------------------------------------------------------------------------

def split_homes(n_layer: int, n_gpu_layers: int, gpus: list[str], weights: list[float] | None = None) -> list[str]:
    """The last n_gpu_layers layers on the GPUs, contiguous ranges in GPU order, sized by `weights`."""
    start = n_layer - n_gpu_layers
    homes = ["CPU"] * start
    if n_gpu_layers <= 0:
        return homes
    w = weights or [1.0] * len(gpus)
    total = sum(w)
    bounds, acc = [], 0.0
    for x in w:
        acc += x
        bounds.append(round(n_gpu_layers * acc / total))
    gi = 0
    for k in range(n_gpu_layers):
        while k >= bounds[gi]:
            gi += 1
        homes.append(gpus[gi])
    return homes


def assignment_from_homes(inv: ModelInventory, homes: list[str], out_dev: str,
                          experts_on: str | None = "CPU") -> dict[str, str]:
    """Every allocated tensor on its layer's home; experts on `experts_on` (None: on their home too)."""
    a: dict[str, str] = {}
    for t in inv.allocated():
        if t.layer is None:
            a[t.name] = "CPU" if t.role == "token_embd" else (out_dev if t.role in ("output", "output_norm") else "CPU")
        elif t.is_expert and experts_on is not None:
            a[t.name] = experts_on
        else:
            a[t.name] = homes[t.layer]
    return a


# ---- filling experts onto the GPUs ----------------------------------------------------------------------------

def layer_order(layers: list[int], order: str) -> list[int]:
    if order == "first":
        return sorted(layers)
    if order == "last":
        return sorted(layers, reverse=True)
    # spread: a bit-reversal-like interleave so every region of the stack gets some GPU experts early
    out, seen = [], set()
    n = len(layers)
    step = n
    while len(out) < n:
        for k in range(0, n, max(step, 1)):
            if k not in seen:
                seen.add(k)
                out.append(layers[k])
        step //= 2
        if step == 0:
            for k in range(n):
                if k not in seen:
                    seen.add(k)
                    out.append(layers[k])
    return out


def _fixed_bytes(inv: ModelInventory, plan: Plan, hw: HardwareProfile | None,
                 estimate: Callable[..., MemoryReport] = estimate) -> dict[str, int]:
    """Per-device bytes that do not change while experts move (KV, compute, overhead) plus current weights."""
    return {d: m.total for d, m in estimate(inv, plan, hw).devices.items()}


def fill_experts(inv: ModelInventory, plan: Plan, room: Room, hw: HardwareProfile | None,
                 order: str = "last", partial: bool = True,
                 estimate: Callable[..., MemoryReport] = estimate) -> Plan:
    """Move CPU-resident expert tensors to their layer's home GPU, whole layers first in `order`, then (if
    `partial`) single up/gate/down tensors of the next layer, while every GPU stays within its room.

    Incremental: each move adds its bytes to the current per-device totals; on one GPU compute buffers only
    shrink as experts leave the CPU (fewer upload targets), so the starting estimate stays an upper bound. Not on
    several: a RAM-resident expert of a CUDA1 layer runs its prompt batches on CUDA0 (op offload uploads it to the
    first GPU), so moving it home moves that compute onto CUDA1, and a plan that ends with every tensor on its
    layer's GPU turns llama.cpp's pipeline parallelism on (memory.pipeline_copies). Nor with mainline's --no-host:
    repacked RAM experts never run on a GPU (residency.repacked), so an expert moved home brings its prompt compute
    onto the GPU (a 12 GiB plan of the Qwen3-30B-A3B shape ended 70 MiB over; the tuner's no-host probe then had
    nothing that fit). In both cases the result is estimated whole and the last moves onto a GPU over its room
    are undone until it fits. `estimate`: the memory model
    (planner.memory's, or an engine's own: planner.engine_contract.memory_model)."""
    used = _fixed_bytes(inv, plan, hw, estimate)
    a = dict(plan.assignment)
    full: dict[str, bool] = {}
    moves: list[tuple[str, list[str]]] = []
    moe = [il for il in inv.moe_layers() if a.get(f"blk.{il}.attn_norm.weight", "CPU") != "CPU"]
    for il in layer_order(moe, order):
        home = a[f"blk.{il}.attn_norm.weight"]
        if full.get(home):
            continue
        exps = [t for t in inv.by_layer[il] if t.is_expert and a[t.name] == "CPU"]
        need = sum(t.nbytes for t in exps)
        if used.get(home, 0) + need <= room.gpus.get(home, 0):
            for t in exps:
                a[t.name] = home
            used[home] = used.get(home, 0) + need
            moves.append((home, [t.name for t in exps]))
            continue
        if partial:
            rank = {r: k for k, r in enumerate(PARTIAL_ORDER)}
            units = [[t] for t in sorted((t for t in exps if not t.name.endswith(".bias")),
                                         key=lambda t: rank.get(t.role, 9))]
            up, gate = (next((u for u in units if u[0].role == r), None) for r in ("exps_up", "exps_gate"))
            if up and gate and ik_fuses_up_gate(plan, up[0], gate[0]):
                # one ik op reads both: an up on the GPU without its gate would copy the gate into the GPU's compute
                # buffer (and a gate without its up run on the CPU), so they move together
                up.extend(units.pop(units.index(gate)))
            for unit in units:
                names = [n for t in unit for n in (t.name, t.name.replace(".weight", ".bias")) if n in a]
                extra = sum(t.nbytes for t in exps if t.name in names)
                if used.get(home, 0) + extra <= room.gpus.get(home, 0):
                    for n in names:
                        a[n] = home
                    moved = list(names)
                    used[home] = used.get(home, 0) + extra
                    moves.append((home, moved))
        full[home] = True
    out = replace(plan, assignment=a)
    if len({d for d in a.values() if d != "CPU"}) > 1 or (plan.dialect == "mainline" and plan.knobs.no_host):
        out = _undo_until_fits(inv, out, room, hw, moves, estimate)
    return out


def _undo_until_fits(inv: ModelInventory, plan: Plan, room: Room, hw: HardwareProfile | None,
                     moves: list[tuple[str, list[str]]],
                     estimate: Callable[..., MemoryReport] = estimate) -> Plan:
    """fill_experts on several GPUs: undo the last moves onto a GPU that the whole estimate puts over its room."""
    a = dict(plan.assignment)
    while True:
        mem = estimate(inv, replace(plan, assignment=a), hw)
        over = {d for d, m in mem.devices.items() if d != "CPU" and m.total > room.gpus.get(d, 0)}
        last = next((k for k in range(len(moves) - 1, -1, -1) if moves[k][0] in over), None)
        if not over or last is None:
            return replace(plan, assignment=a)
        for name in moves.pop(last)[1]:
            a[name] = "CPU"


# ---- strategies -------------------------------------------------------------------------------------------------

def _plan(inv: ModelInventory, a: dict[str, str], knobs: Knobs, dialect: Dialect, label: str) -> Plan:
    return Plan(model_id(inv), a, knobs, dialect, label)


Strategy = Literal["experts-cpu+fill", "experts-cpu", "layers", "output-only"]


@dataclass(frozen=True)
class Proposal:
    """A plan propose() made and the parameters it made it with. The label (also the plan's) is built from them,
    so whoever needs the parameters (the tuner, seeding its space with proposals) reads the fields, never the
    label's text."""
    plan: Plan
    strategy: Strategy
    order: Order | None = None       # experts-cpu+fill: the layer order the experts filled the GPUs in
    n_gpu_layers: int = 0            # layers homed on the GPUs (experts-cpu*: their experts on the CPU)

    @classmethod
    def of(cls, plan: Plan, strategy: Strategy, *, order: Order | None = None, n_gpu_layers: int = 0) -> Proposal:
        """The proposal, its plan labelled from the parameters."""
        p = cls(plan, strategy, order, n_gpu_layers)
        return replace(p, plan=replace(plan, label=p.label))

    @property
    def label(self) -> str:
        """experts-cpu+fill-ORDER, experts-cpu, layers-N or output-only: what `plan` lists and trials' sources say."""
        if self.strategy == "experts-cpu+fill":
            return f"experts-cpu+fill-{self.order}"
        if self.strategy == "layers":
            return f"layers-{self.n_gpu_layers}"
        return self.strategy


def max_gpu_layers(inv: ModelInventory, hw: HardwareProfile, room: Room, knobs: Knobs, dialect: Dialect,
                   experts_on_cpu: bool, *, weights: list[float] | None = None, output_on_gpu: bool = True) -> int:
    """Largest number of trailing layers whose homes fit on the GPUs (binary search; fits is monotone).

    `weights` split the layers between GPUs (default: by VRAM); `output_on_gpu` puts the output layer with the
    last homed layer (else it stays on the CPU). Returns -1 when not even zero layers fit (host RAM)."""
    gpus = gpu_names(len(hw.gpus))
    weights = weights or [float(g.vram_bytes) for g in hw.gpus]

    def fits(n: int) -> bool:
        homes = split_homes(inv.n_layer, n, gpus, weights)
        out_dev = homes[-1] if n > 0 and output_on_gpu else "CPU"
        a = assignment_from_homes(inv, homes, out_dev, "CPU" if experts_on_cpu else None)
        return room.fits(estimate(inv, _plan(inv, a, knobs, dialect, ""), hw))

    lo, hi = 0, inv.n_layer
    if not fits(0):
        return -1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def propose(inv: ModelInventory, hw: HardwareProfile, knobs: Knobs = Knobs(), dialect: Dialect = "mainline",
            margin: int = DEFAULT_MARGIN, orders: Iterable[str] = ORDERS) -> list[Plan]:
    """Candidate plans, best-informed first (the plans of `proposals`)."""
    return [p.plan for p in proposals(inv, hw, knobs, dialect, margin, orders)]


def proposals(inv: ModelInventory, hw: HardwareProfile, knobs: Knobs = Knobs(), dialect: Dialect = "mainline",
              margin: int = DEFAULT_MARGIN, orders: Iterable[str] = ORDERS) -> list[Proposal]:
    """Candidate plans with how each was made, best-informed first: experts-on-CPU plus filling in each order,
    and whole layers.

    Raises BudgetError when not even the output layer and the KV of one layer fit."""
    room = Room.from_hardware(hw, margin)
    gpus = gpu_names(len(hw.gpus))
    weights = [float(g.vram_bytes) for g in hw.gpus]
    plans: list[Proposal] = []
    n_dense = max_gpu_layers(inv, hw, room, knobs, dialect, experts_on_cpu=True) if inv.hparams.is_moe else -1
    if n_dense >= 0 and inv.hparams.is_moe:
        homes = split_homes(inv.n_layer, n_dense, gpus, weights)
        out_dev = homes[-1] if n_dense > 0 else gpus[-1]
        base = _plan(inv, assignment_from_homes(inv, homes, out_dev, "CPU"), knobs, dialect, "experts-cpu")
        if not room.fits(estimate(inv, base, hw)):
            base = _plan(inv, assignment_from_homes(inv, homes, "CPU", "CPU"), knobs, dialect, "experts-cpu")
        for order in orders:
            filled = fill_experts(inv, base, room, hw, order)
            plans.append(Proposal.of(filled, "experts-cpu+fill", order=order, n_gpu_layers=n_dense))
        plans.append(Proposal.of(base, "experts-cpu", n_gpu_layers=n_dense))
    n_full = max_gpu_layers(inv, hw, room, knobs, dialect, experts_on_cpu=False)
    if n_full >= 0:
        homes = split_homes(inv.n_layer, n_full, gpus, weights)
        out_dev = homes[-1] if n_full > 0 else "CPU"
        a = assignment_from_homes(inv, homes, out_dev, None)
        p = Proposal.of(_plan(inv, a, knobs, dialect, ""), "layers", n_gpu_layers=n_full)
        if n_full == 0:   # not even one layer: try the output layer alone (mainline -ngl 1)
            a1 = assignment_from_homes(inv, homes, gpus[-1], None)
            p1 = Proposal.of(_plan(inv, a1, knobs, dialect, ""), "output-only")
            if room.fits(estimate(inv, p1.plan, hw)):
                p = p1
        plans.append(p)
    useful = [p for p in plans if any(d != "CPU" for d in p.plan.assignment.values())]
    if not useful:
        cpu_only = _plan(inv, assignment_from_homes(inv, ["CPU"] * inv.n_layer, "CPU", None), knobs, dialect, "cpu")
        if not room.fits(estimate(inv, cpu_only, hw)):
            cpu = estimate(inv, cpu_only, hw).devices["CPU"]
            raise BudgetError(f"nothing fits: host RAM {fmt_bytes(room.host)} < KV + compute "
                              f"{fmt_bytes(cpu.kv + cpu.compute)} with every tensor on the CPU; "
                              "lower --ctx or --ubatch")
        probe = _plan(inv, assignment_from_homes(inv, ["CPU"] * inv.n_layer, gpus[-1], None), knobs, dialect, "")
        raise BudgetError(_output_alone(inv, hw, room, margin, estimate(inv, probe, hw).devices[gpus[-1]], gpus[-1]))
    return plans


def _output_alone(inv: ModelInventory, hw: HardwareProfile, room: Room, margin: int, dev: DeviceMemory,
                  name: str) -> str:
    """Why not even the output layer fits: its device's memory in parts, the weights as `inspect` counts them."""
    kept = f"{fmt_bytes(hw.keep_free_bytes)} kept free" if hw.keep_free_bytes else "nothing kept free"
    if margin:
        kept += f" and a {fmt_bytes(margin)} margin"
    rest = dev.total - dev.weights - dev.overhead        # KV (none without layers) and the compute buffers
    return (f"nothing fits on the GPU: {name} has {fmt_bytes(room.gpus[name])} after {kept}, but even the output "
            f"layer alone needs {fmt_bytes(dev.total)} there: its weights {fmt_bytes(dev.weights)} (output and its "
            f"norm), the CUDA context {fmt_bytes(dev.overhead)} and the compute buffers {fmt_bytes(rest)}; "
            "give more --gpu memory, a smaller --keep-free or a smaller --ubatch")


# ---- choosing among candidates ------------------------------------------------------------------------------------

Objective = Literal["tg", "pp", "both"]   # both: the geometric mean of the two speeds (tune's word too)


@dataclass(frozen=True)
class Scored:
    proposal: Proposal
    memory: MemoryReport
    pp_tps: float
    tg_tps: float
    host: HostBill | None = None          # the host's bill against the RAM (no prompt cache counted)

    @property
    def plan(self) -> Plan:
        return self.proposal.plan

    def score(self, objective: str) -> tuple[float, float]:
        """(primary, tie-break): the objective first, the other speed second."""
        if objective == "pp":
            return self.pp_tps, self.tg_tps
        if objective == "both":
            return (self.pp_tps * self.tg_tps) ** 0.5, self.tg_tps
        return self.tg_tps, self.pp_tps


def knob_variants(knobs: Knobs, dialect: Dialect = "mainline") -> list[Knobs]:
    """The same knobs with op offload on and off, and CPU weights mmap'd or pinned (no mmap): the two switches
    that most change PP once experts sit in RAM (docs/llamacpp.md section 4), and that change the compute buffer and
    host memory, so each gets its own placement. ik can also keep dense ops offloaded while the MoE ops run on
    the CPU (-op 28,0,31,0), which pays when uploading the experts costs more than it saves."""
    from .plan import OffloadPolicy, OpRule
    mb = knobs.offload.moe_matmul.min_batch
    policies = [OffloadPolicy.all(True, mb), OffloadPolicy.all(False, mb)]
    if dialect == "ik":
        on, off = OpRule(True, mb), OpRule(False, mb)
        policies.append(OffloadPolicy(dense_matmul=on, moe_matmul=off, moe_fused_up_gate=off, output=on))
    return [replace(knobs, offload=pol, mmap=mmap) for pol in policies for mmap in (True, False)]


def best_plans(inv: ModelInventory, hw: HardwareProfile, knobs: Knobs = Knobs(), dialect: Dialect = "mainline",
               objective: str = "tg", margin: int = DEFAULT_MARGIN, n_prompt: int = 512) -> list[Scored]:
    """Every proposal for every knob variant that fits, scored by the cost model, best first. Weights in RAM past
    the RAM do not keep a plan out (mmap'd, they are read back from disk): the cost model prices them at the disk's
    rate (planner/host.py), so a plan that fits the RAM ranks above one that does not.
    Raises BudgetError (from propose) when nothing fits at all."""
    from .cost import predict
    from .host import host_bill
    room = Room.from_hardware(hw, margin)
    scored: dict[str, Scored] = {}
    error: BudgetError | None = None
    for k in knob_variants(knobs, dialect):
        try:
            props = proposals(inv, hw, k, dialect, margin)
        except BudgetError as e:
            error = error or e
            continue
        for p in props:
            mem = estimate(inv, p.plan, hw)
            if room.fits(mem):
                bill = host_bill(mem, hw.host.ram_bytes)
                pr = predict(inv, p.plan, hw, n_prompt=n_prompt, disk_share=bill.disk_share)
                scored.setdefault(p.plan.id, Scored(p, mem, pr.pp_tps, pr.tg_tps, bill))
    if not scored:
        raise error or BudgetError("nothing fits in the given memory")
    return sorted(scored.values(), key=lambda s: s.score(objective), reverse=True)


def distinct(ranked: Iterable[Scored]) -> list[Scored]:
    """RANKED (best first) without the candidates a user could not tell from a better-ranked one: the same
    placement with the same predicted PP, TG and GPU memory, only a switch that changes nothing there differing
    (op offload with every weight on the GPU; mmap once op offload is off). The first of them is kept: under a
    tie it is the earlier knob variant (knob_variants), the one with the fewer flags."""
    out: list[Scored] = []
    for s in ranked:
        if not any(_same_row(s, k) for k in out):
            out.append(s)
    return out


def _same_row(a: Scored, b: Scored) -> bool:
    def gpus(s: Scored) -> dict[str, int]:
        return {d: m.total for d, m in s.memory.devices.items() if d != "CPU"}
    return (a.plan.assignment == b.plan.assignment and gpus(a) == gpus(b)
            and math.isclose(a.pp_tps, b.pp_tps, rel_tol=1e-9) and math.isclose(a.tg_tps, b.tg_tps, rel_tol=1e-9))
