"""The host's bill: what a plan keeps in host RAM, part by part, against the RAM it may use (--ram).

Parts (docs/llamacpp.md section 6, "Host RAM"): the weights left in RAM, mmap'd from the file (page cache) or
pinned / anonymous (--no-mmap, mainline --no-host's repacked weights, ik's computed attn_kv_b); the KV cells and the
compute buffer on the CPU; the process itself (code, tokenizer, small host buffers: memory.HOST_PROCESS_OVERHEAD);
and llama-server's prompt cache, which keeps the KV of earlier prompts in RAM up to --cache-ram MiB
(common/common.h cache_ram_mib, 8192 by default in both forks: llama.cpp PR 16391, ik PR 954; -1 no limit, 0 off).
The prompt cache fills what it is let have, so a plan emits --cache-ram sized to what the rest leaves
(cache_ram_for) and it never decides whether a plan fits.

Weights in RAM beyond what the RAM holds do not fail to load when mmap'd: the kernel drops pages and reads them back
from the file as tokens touch them. The cost model reads that share of the CPU's weights at the disk's rate
(HardwareProfile host.disk_read_bytes_per_s; HostBill.disk_share), plan and explain warn (W104, one line naming the
shortfall), and tune refuses such a config (tuner/space.py over_budget) or, when not even the GPUs' whole memory
leaves few enough weights in RAM, the study (ram_floor).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any
from collections.abc import Mapping

from .hardware import MiB, HardwareProfile, fmt_bytes
from .memory import HOST_PROCESS_OVERHEAD, MemoryReport, estimate
from .model import ModelInventory
from .plan import Plan

DEFAULT_CACHE_RAM_MIB = 8192      # llama-server's --cache-ram default (common/common.h cache_ram_mib, both forks)


@dataclass(frozen=True)
class HostBill:
    """Bytes a plan keeps in host RAM, by part, and the RAM it may use."""
    ram: int                          # the RAM the plan may use (--ram; the profile's host.ram_bytes)
    weights_mapped: int               # CPU weights served from the mmap'd file (page cache)
    weights_pinned: int               # CPU weights copied into pinned / anonymous memory
    kv: int                           # KV cells on the CPU
    compute: int                      # the CPU's compute buffer
    process: int                      # the process itself
    prompt_cache: int = 0             # llama-server's prompt cache, at its --cache-ram
    cache_ram_mib: int | None = None  # the --cache-ram the prompt cache is at (None: no prompt cache counted)

    @property
    def weights(self) -> int:
        return self.weights_mapped + self.weights_pinned

    @property
    def need(self) -> int:
        """What the plan cannot run without: weights, KV, compute and the process."""
        return self.weights + self.kv + self.compute + self.process

    @property
    def total(self) -> int:
        return self.need + self.prompt_cache

    @property
    def shortfall(self) -> int:
        """Bytes over the RAM (0 when everything fits): the prompt cache, once full, pushes weights out too."""
        return max(0, self.total - self.ram)

    @property
    def left(self) -> int:
        """RAM the weights, KV, compute and the process leave free (what a prompt cache may have)."""
        return max(0, self.ram - self.need)

    @property
    def disk_share(self) -> float:
        """The share of the CPU's weight reads that come from disk: the bytes over the RAM, of the weights in RAM."""
        if not self.shortfall or not self.weights:
            return 0.0
        return min(1.0, self.shortfall / self.weights)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "weights": self.weights, "need": self.need, "total": self.total,
                "shortfall": self.shortfall, "disk_share": self.disk_share}

    @classmethod
    def from_memory_dict(cls, memory: Mapping[str, Any], ram: int) -> HostBill:
        """From MemoryReport.to_dict() as a study stores a candidate's memory (no prompt cache counted)."""
        cpu = memory.get("devices", {}).get("CPU", {})
        host = memory.get("host", {})
        return cls(ram, int(host.get("mapped", 0)), int(host.get("pinned", 0)), int(cpu.get("kv", 0)),
                   int(cpu.get("compute", 0)), int(cpu.get("overhead", 0)))


def host_bill(report: MemoryReport, ram: int, cache_ram_mib: int | None = None) -> HostBill:
    """The host's bill of a memory report against `ram`; with the prompt cache at `cache_ram_mib` (-1: no limit, it
    takes what is left) when given."""
    cpu = report.devices.get("CPU")
    bill = HostBill(ram, report.host_mapped, report.host_pinned, cpu.kv if cpu else 0, cpu.compute if cpu else 0,
                    cpu.overhead if cpu else 0)
    return with_prompt_cache(bill, cache_ram_mib) if cache_ram_mib is not None else bill


def with_prompt_cache(bill: HostBill, cache_ram_mib: int) -> HostBill:
    cache = bill.left if cache_ram_mib < 0 else cache_ram_mib * MiB
    return replace(bill, prompt_cache=cache, cache_ram_mib=cache_ram_mib)


def disk_share_of(inv: ModelInventory, plan: Plan, hw: HardwareProfile) -> float:
    """HostBill.disk_share of `plan` on `hw`, as the cost model prices it unless told (planner.cost.predict): 0 at
    once when the whole model and the process fit in half the RAM (KV and compute never take the other half
    without the memory model refusing the plan), else from the memory model's estimate."""
    if inv.total_bytes() + HOST_PROCESS_OVERHEAD <= hw.host.ram_bytes // 2:
        return 0.0
    return host_bill(estimate(inv, plan, hw), hw.host.ram_bytes).disk_share


def cache_ram_for(bill: HostBill) -> int:
    """The --cache-ram (MiB) a plan emits: llama-server's default where the RAM has room for it, else what is left
    (0, no prompt cache, when nothing is)."""
    return min(DEFAULT_CACHE_RAM_MIB, bill.left // MiB)


def shortfall_warning(bill: HostBill, disk_read_bytes_per_s: float) -> str | None:
    """W104, one line: how far the host's bill is over the RAM, and what that costs; None when it fits."""
    if not bill.shortfall:
        return None
    disk = (f"{bill.disk_share:.0%} of the weights read from RAM come from disk on every token, predicted at "
            f"{disk_read_bytes_per_s / 1e9:.1f} GB/s")
    if bill.need <= bill.ram:        # only the prompt cache, once full, is over
        return (f"W104 host RAM short by {fmt_bytes(bill.shortfall)} once llama-server's prompt cache fills: "
                f"--cache-ram {bill.cache_ram_mib} lets it grow to {fmt_bytes(bill.prompt_cache)}, but the weights in "
                f"RAM ({fmt_bytes(bill.weights)}), KV, compute and the process leave {fmt_bytes(bill.left)} of the "
                f"{fmt_bytes(bill.ram)} RAM (--ram); then {disk}; give --cache-ram {cache_ram_for(bill)} or less")
    cache = (f", llama-server's prompt cache {fmt_bytes(bill.prompt_cache)} (--cache-ram {bill.cache_ram_mib})"
             if bill.prompt_cache else "")
    return (f"W104 host RAM short by {fmt_bytes(bill.shortfall)}: {fmt_bytes(bill.weights)} of weights stay in RAM "
            f"and with KV, compute and the process{cache} need {fmt_bytes(bill.total)} of the {fmt_bytes(bill.ram)} "
            f"RAM (--ram); {disk}; give more --ram or --gpu memory, or take a smaller quant")


def host_line(bill: HostBill) -> str:
    """The host's row in parts, as plan, explain and the report print it."""
    cache = ""
    if bill.cache_ram_mib is not None:
        cache = f", prompt cache {fmt_bytes(bill.prompt_cache)} (--cache-ram {bill.cache_ram_mib})"
    end = f"{fmt_bytes(bill.shortfall)} short" if bill.shortfall else f"{fmt_bytes(bill.ram - bill.total)} free"
    return (f"host RAM {fmt_bytes(bill.ram)}: weights {fmt_bytes(bill.weights)} (mmap'd "
            f"{fmt_bytes(bill.weights_mapped)}, pinned {fmt_bytes(bill.weights_pinned)}), KV {fmt_bytes(bill.kv)}, "
            f"compute {fmt_bytes(bill.compute)}{cache}, process {fmt_bytes(bill.process)}: {fmt_bytes(bill.total)}, "
            f"{end}")


def ram_floor(inv: ModelInventory, hw: HardwareProfile) -> int:
    """The least host RAM any placement of `inv` on `hw` needs: the input embedding (llama.cpp keeps it in RAM),
    every weight the GPUs cannot hold even whole (their memory less what is kept free and the CUDA context, nothing
    for KV or compute), and the process."""
    emb = inv.by_name.get("token_embd.weight")
    emb_bytes = emb.nbytes if emb is not None else 0
    room = sum(max(0, g.vram_bytes - hw.keep_free_bytes - g.overhead_bytes) for g in hw.gpus)
    return emb_bytes + max(0, inv.total_bytes() - emb_bytes - room) + HOST_PROCESS_OVERHEAD


def ram_floor_error(inv: ModelInventory, hw: HardwareProfile) -> str | None:
    """One line when not even the GPUs' whole memory leaves few enough weights in RAM (no config can fit)."""
    floor = ram_floor(inv, hw)
    if floor <= hw.host.ram_bytes:
        return None
    return (f"nothing fits in host RAM: {inv.name or inv.source} has {fmt_bytes(inv.total_bytes())} of weights and the "
            f"GPUs hold at most {fmt_bytes(inv.total_bytes() + HOST_PROCESS_OVERHEAD - floor)} of them, so at least "
            f"{fmt_bytes(floor)} stays in RAM with the process, more than the {fmt_bytes(hw.host.ram_bytes)} of RAM "
            "(--ram); give more --ram or --gpu memory, or take a smaller quant")
