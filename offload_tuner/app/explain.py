"""explain: what a llama.cpp command line does: placement, memory, speed, warnings."""
from __future__ import annotations

from dataclasses import dataclass, replace

from planner.errors import InputError
from planner.hardware import MiB, HardwareProfile, fmt_bytes, from_gpu_sizes
from planner.model import ModelInventory
from planner.plan import Plan, gpu_index, is_gpu
from planner.validate import check_dialect
from planner.host import HostBill, host_bill, shortfall_warning
from .common import hardware, target_build, with_ram_of
from .requests import ExplainRequest


def layer_summary(inv: ModelInventory, assignment: dict[str, str]) -> list[dict]:
    """Runs of consecutive layers with the same placement pattern: home device and where experts sit."""
    from planner.flags import home_devices
    homes = home_devices(assignment, inv)
    rows: list[dict] = []
    for il in range(inv.n_layer):
        tensors = [t for t in inv.by_layer.get(il, ()) if t.role != "nextn"]
        if not tensors:
            continue
        home = homes[il] or "CPU"
        others = sorted({assignment.get(t.name, "CPU") for t in tensors if not t.is_expert})
        exps = {}
        for t in tensors:
            if t.is_expert and t.name.endswith(".weight"):
                exps[t.role.replace("exps_", "")] = assignment.get(t.name, "CPU")
        key = (home, tuple(others), tuple(sorted(exps.items())))
        if rows and rows[-1]["key"] == key and rows[-1]["last"] == il - 1:
            rows[-1]["last"] = il
        else:
            rows.append({"key": key, "first": il, "last": il, "home": home, "dense": others, "experts": exps})
    for r in rows:
        r.pop("key")
    return rows


@dataclass(frozen=True)
class ExplainOutcome:
    """What `explain` reports (text, `--json` and the service read the same object)."""
    dialect: str
    inv: ModelInventory
    hw: HardwareProfile
    plan: Plan
    mem: object
    pred: object
    warnings: list
    oracle: tuple | None        # (JSON, text table) of llama-fit-params beside our memory model
    oracle_path: str | None = None
    host: HostBill | None = None    # host RAM in parts, the prompt cache at the command's --cache-ram

    def to_json(self) -> dict:
        return {"model": self.inv.name, "dialect": self.dialect, "hardware": self.hw.name, "plan": self.plan.to_dict(),
                **self.mem.to_dict(), "predicted": {"pp_tps": self.pred.pp_tps, "tg_tps": self.pred.tg_tps},
                "layers": layer_summary(self.inv, self.plan.assignment), "warnings": self.warnings,
                "host_ram": self.host.to_dict() if self.host else None,
                **({"oracle": self.oracle[0]} if self.oracle else {})}


def explain_outcome(req: ExplainRequest) -> ExplainOutcome:
    from planner.cost import predict
    from planner.flags import parse
    from planner.loader import load_model
    from planner.memory import estimate
    inv = load_model(req.model)
    if not req.args:
        raise InputError("give the llama.cpp arguments after --, e.g. explain MODEL -- -ngl 99 -ot exps=CPU")
    check_dialect(inv, req.dialect)
    hw = hardware(req.hardware, req.gpu, required=False, ram=req.ram)
    build = target_build(req.build, req.dialect)
    # the declared hardware bounds the device names (llama.cpp refuses a buffer type of a GPU it does not see)
    parsed = parse(list(req.args), inv, req.dialect, n_gpus=len(hw.gpus) if hw is not None else None, build=build)
    plan = Plan(inv.source or inv.name, parsed.assignment, parsed.knobs, req.dialect, "explained")
    n_gpus = max([gpu_index(d) + 1 for d in plan.assignment.values() if is_gpu(d)] or [0])
    if hw is None:
        hw = with_ram_of(from_gpu_sizes(",".join(["24GiB"] * max(n_gpus, parsed.n_gpus, 1))), req.ram, profile=False)
    mem = estimate(inv, plan, hw)
    warnings = list(parsed.warnings)     # (-nkvo: the parser already warns)
    over = [d for d, m in mem.devices.items()
            if is_gpu(d) and gpu_index(d) < len(hw.gpus) and m.total > hw.gpu(d).vram_bytes]
    fitted = _fitted(inv, plan, hw, parsed.fit_target_mib) if over and parsed.fit_moves_experts else None
    if fitted is not None:
        fmem = estimate(inv, fitted, hw)
        n_ram = len({t.layer for t in inv.allocated() if t.is_expert and fitted.assignment[t.name] == "CPU"
                     and plan.assignment[t.name] != "CPU"})
        warnings.append(f"W101 as written it needs {fmt_bytes(mem.devices[over[0]].total)} on {over[0]} (of "
                        f"{fmt_bytes(hw.gpu(over[0]).vram_bytes)}); llama.cpp's fit (on by default) moves the experts "
                        f"of {n_ram} layers to RAM to keep {parsed.fit_target_mib[0]} MiB free: explained as fitted "
                        "(-fit off would run out of memory)")
        for d, m in fmem.devices.items():
            if is_gpu(d) and gpu_index(d) < len(hw.gpus):
                warnings.append(f"W102 {d}: the fit leaves {fmt_bytes(hw.gpu(d).vram_bytes - m.total)} unused "
                                "(its -fitt margin and the last layer that did not fit); `plan` or `tune` with "
                                "--gpu finds a placement that uses it")
        plan, mem = fitted, fmem
        warnings = [w for w in warnings if not w.startswith("W009")]     # W101 says what the fit does
    else:
        for dev in over:
            warnings.append(f"W100 {dev} needs {fmt_bytes(mem.devices[dev].total)} but has "
                            f"{fmt_bytes(hw.gpu(dev).vram_bytes)}: this command would run out of memory")
    host = host_bill(mem, hw.host.ram_bytes, prompt_cache_mib(parsed, build))
    if (short := shortfall_warning(host, hw.host.disk_read_bytes_per_s)) is not None:
        warnings.append(short)
    pred = predict(inv, plan, hw, disk_share=host.disk_share)
    oracle = None
    if req.oracle:
        from runtime.run import oracle_compare      # runs llama-fit-params: runtime/, imported here only
        from planner.gguf_header import first_shard     # llama.cpp loads a split only from its first shard
        oracle = oracle_compare(inv, plan, mem, first_shard(req.model), req.oracle)
    return ExplainOutcome(req.dialect, inv, hw, plan, mem, pred, warnings, oracle, req.oracle, host)


def prompt_cache_mib(parsed, build) -> int | None:
    """The prompt cache a command keeps in RAM, MiB: its --cache-ram, else llama-server's default where the build
    has one (-1: no limit); None for a program that keeps none."""
    from planner.builds import Spelling
    from planner.host import DEFAULT_CACHE_RAM_MIB
    if parsed.cache_ram_mib is not None:
        return parsed.cache_ram_mib
    return DEFAULT_CACHE_RAM_MIB if parsed.tool == "server" and build.accepts(Spelling.CACHE_RAM) else None


def _fitted(inv: ModelInventory, plan: Plan, hw: HardwareProfile, target_mib: tuple[int, ...]) -> Plan | None:
    """What mainline's --fit does with a placement that gives no expert overrides (docs/llamacpp.md section 7):
    every expert of a GPU layer in RAM, then each GPU filled from the back with whole layers' experts and one
    partial layer, keeping `target_mib` free (one value for every GPU, or one per GPU). None when even every
    expert in RAM does not fit (the fit would then shrink an unset -c, or -ngl)."""
    from planner.memory import estimate
    from planner.propose import Room, fill_experts
    cpu = replace(plan, assignment={n: "CPU" if t.is_expert else plan.assignment[n]
                                    for n, t in ((t.name, t) for t in inv.allocated())})
    gpus = {f"CUDA{i}": g.vram_bytes - (target_mib[i] if i < len(target_mib) else target_mib[-1]) * MiB
            for i, g in enumerate(hw.gpus)}
    budget = Room(gpus, hw.host.ram_bytes)
    if not budget.fits(estimate(inv, cpu, hw)):
        return None
    aim = dict(gpus)
    for _ in range(4):      # fill_experts adds tensor bytes; a partial layer can grow a compute buffer: aim lower
        out = fill_experts(inv, cpu, Room(aim, hw.host.ram_bytes), hw, order="last", partial=True)
        mem = estimate(inv, out, hw)
        over = {d: mem.devices[d].total - b for d, b in gpus.items() if d in mem.devices and mem.devices[d].total > b}
        if not over:
            return replace(out, label="fitted by llama.cpp")
        aim = {d: b - over.get(d, 0) for d, b in aim.items()}
    return None
