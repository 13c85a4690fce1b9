"""Plain text tables the commands print (tables of memory per device, of a model's tensor groups, of runs): one
presentation module that the CLI, the runtime's `run` and the study reports share, so none of them reaches into
another layer for a table."""
from __future__ import annotations

from .hardware import fmt_bytes
from .host import HostBill, host_line
from .memory import MemoryReport
from .model import ModelInventory
from .plan import device_sort_key


def table(headers: list[str], rows: list[list[object]], right: set[int] | None = None) -> str:
    """Plain aligned text table; columns in `right` (default: all but the first) are right-aligned."""
    right = set(range(1, len(headers))) if right is None else right
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        cells = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def memory_table(report: MemoryReport, budgets: dict[str, int] | None = None, host: HostBill | None = None) -> str:
    """Bytes per device and part, each GPU against its budget; with `host`, the CPU against the RAM and the host's
    row in parts below (planner/host.py: weights mmap'd and pinned, KV, compute, prompt cache, process)."""
    budgets = {**(budgets or {}), **({"CPU": host.ram} if host is not None else {})}
    pool = any(m.pool for m in report.devices.values())     # ik's CUDA pool: a column only where there is one
    rows = []
    for dev in sorted(report.devices, key=device_sort_key):
        m = report.devices[dev]
        b = budgets.get(dev)
        rows.append([dev, fmt_bytes(m.weights), fmt_bytes(m.kv), fmt_bytes(m.compute), fmt_bytes(m.overhead),
                     *([fmt_bytes(m.pool)] if pool else []), fmt_bytes(m.total), fmt_bytes(b) if b else "-"])
    text = table(["device", "weights", "kv", "compute", "overhead", *(["pool"] if pool else []), "total", "budget"],
                 rows)
    if host is not None:
        text += "\n" + host_line(host)
    elif report.host_mapped or report.host_pinned:
        text += (f"\nCPU weights: {fmt_bytes(report.host_mapped)} mmap'd (page cache, evictable), "
                 f"{fmt_bytes(report.host_pinned)} pinned")
    return text


def inventory_summary(inv: ModelInventory) -> str:
    hp = inv.hparams
    parts = [f"{inv.name or inv.source} ({hp.arch}, {hp.n_layer} layers"]
    if hp.n_nextn:
        parts.append(f" incl. {hp.n_nextn} NextN")
    if hp.is_moe:
        parts.append(f", {hp.n_expert} experts / {hp.n_expert_used} used")
    parts.append(f", {fmt_bytes(inv.total_bytes())})")
    return "".join(parts)
