"""The whole host bill (issue 40, item 3): --ram on plan, explain, tune and the service; the memory table's host row
in parts (weights in RAM mmap'd and pinned, KV and compute on the CPU, llama-server's prompt cache at the emitted
--cache-ram, the process); a plan whose weights in RAM do not fit gets one warning naming the shortfall and its
speed at the disk's rate; tune never picks such a config, and refuses in one line when every config is one."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from offload_tuner import cli
from offload_tuner.app import explain_outcome, plan_outcome
from offload_tuner.app.common import hardware, machine_ram_bytes
from offload_tuner.app.requests import ExplainRequest, PlanRequest, TuneRequest
from planner.builds import parse_build
from planner.cost import predict
from planner.errors import BudgetError
from planner.flags import parse, render
from planner.hardware import DEFAULT_DISK_READ, GiB, MiB, from_gpu_sizes, load_hardware
from planner.host import DEFAULT_CACHE_RAM_MIB, HostBill, cache_ram_for, host_bill, ram_floor
from planner.loader import load_model
from planner.memory import estimate
from planner.propose import propose

DEEPSEEK = "preset:DeepSeek-V3:Q4_K_M"
QWEN = "preset:Qwen3-30B-A3B:Q4_K_M"


def w104(warnings) -> list[str]:
    return [w for w in warnings if w.startswith("W104")]


@pytest.mark.parametrize("dialect", ["mainline", "ik"])
def test_deepseek_on_24gib_with_128gib_of_ram_warns_and_reads_from_disk(dialect):
    short = plan_outcome(PlanRequest(DEEPSEEK, gpu="24GiB", ram="128GiB", dialect=dialect, objective="tg"))
    (line,) = w104(short.warnings)                      # one warning line, naming the shortfall
    assert f"short by {short.host.shortfall / GiB:.2f} GiB" in line and "--ram" in line
    assert short.host.ram == 128 * GiB and short.host.shortfall > 200 * GiB and short.host.disk_share > 0.5
    # its speed is the disk's: a token faults in most of the experts' bytes at 3 GB/s
    roomy = plan_outcome(PlanRequest(DEEPSEEK, gpu="24GiB", ram="512GiB", dialect=dialect, objective="tg"))
    assert not w104(roomy.warnings) and roomy.host.shortfall == 0
    assert short.ranked[0].tg_tps < 0.2 * roomy.ranked[0].tg_tps
    # the prompt cache: nothing left at 128 GiB, llama-server's default at 512
    assert short.cmds.lines["llama-server"].endswith("--cache-ram 0")
    assert roomy.cmds.lines["llama-server"].endswith(f"--cache-ram {DEFAULT_CACHE_RAM_MIB}")
    assert roomy.host.prompt_cache == DEFAULT_CACHE_RAM_MIB * MiB and "--cache-ram" not in roomy.cmds.lines["llama-cli"]
    d = short.to_json()["host_ram"]
    assert d["shortfall"] == short.host.shortfall and d["cache_ram_mib"] == 0


def test_the_cost_models_disk_term():
    inv = load_model(DEEPSEEK)
    hw = from_gpu_sizes("24GiB").with_ram(128 * GiB)
    plan = propose(inv, hw)[0]
    bill = host_bill(estimate(inv, plan, hw), hw.host.ram_bytes)
    fits = predict(inv, plan, hw, disk_share=0.0)
    short = predict(inv, plan, hw)                      # the default: the memory model's share for hw's RAM
    assert short.tg_s == pytest.approx(predict(inv, plan, hw, disk_share=bill.disk_share).tg_s)
    disk = short.breakdown["tg.cpu_disk"]
    assert disk == pytest.approx(short.tg_s - fits.tg_s) and disk > 1.0      # seconds a token
    assert "tg.cpu_disk" not in fits.breakdown
    slow = replace(hw, host=replace(hw.host, disk_read_bytes_per_s=DEFAULT_DISK_READ / 2))
    assert predict(inv, plan, slow).breakdown["tg.cpu_disk"] == pytest.approx(2 * disk)


def test_plan_and_explain_print_the_host_row_in_parts(capsys):
    assert cli.main(["plan", DEEPSEEK, "--gpu", "24GiB", "--ram", "128GiB", "--objective", "tg"]) == 0
    out = capsys.readouterr().out
    assert "host 128.00 GiB RAM" in out.splitlines()[1]               # the hardware line
    host = next(ln for ln in out.splitlines() if ln.startswith("host RAM"))
    for part in ("weights", "mmap'd", "pinned", "KV", "compute", "prompt cache 0 B (--cache-ram 0)", "process",
                 "short"):
        assert part in host
    assert sum(ln.startswith("warning: W104") for ln in out.splitlines()) == 1
    cpu = next(ln for ln in out.splitlines() if ln.startswith("CPU "))
    assert cpu.endswith("128.00 GiB")                                 # the CPU row's budget: the RAM
    assert cli.main(["explain", QWEN, "--gpu", "16GiB", "--ram", "64GiB", "--", "llama-server", "-ngl", "99",
                     "-cmoe", "-c", "8192", "-np", "1", "-fa", "on"]) == 0
    out = capsys.readouterr().out
    assert "host 64.00 GiB RAM" in out
    host = next(ln for ln in out.splitlines() if ln.startswith("host RAM 64.00 GiB"))
    assert f"prompt cache 8.00 GiB (--cache-ram {DEFAULT_CACHE_RAM_MIB})" in host and "free" in host


def test_explain_bills_the_commands_own_cache_and_says_what_fits():
    args = ("llama-server", "-ngl", "99", "-cmoe", "-c", "8192", "-np", "1", "-fa", "on")
    o = explain_outcome(ExplainRequest("preset:gpt-oss-120b", args=args, gpu="24GiB", ram="64GiB"))
    (line,) = w104(o.warnings)           # the weights fit; llama-server's default prompt cache, once full, does not
    assert "once llama-server's prompt cache fills" in line and f"--cache-ram {cache_ram_for(o.host)} or less" in line
    given = explain_outcome(ExplainRequest("preset:gpt-oss-120b", args=(*args, "--cache-ram", "2048"), gpu="24GiB",
                                           ram="64GiB"))
    assert not w104(given.warnings) and given.host.prompt_cache == 2 * GiB and given.host.cache_ram_mib == 2048
    assert given.pred.tg_tps > o.pred.tg_tps
    bench = explain_outcome(ExplainRequest("preset:gpt-oss-120b", args=("llama-bench", "-ngl", "99", "-ncmoe", "36"),
                                           gpu="24GiB", ram="64GiB"))
    assert bench.host.prompt_cache == 0 and bench.host.cache_ram_mib is None        # llama-bench keeps none
    assert given.to_json()["host_ram"]["cache_ram_mib"] == 2048


def test_ram_defaults_to_this_machine_for_gpu_alone_and_to_the_profile_otherwise(monkeypatch):
    monkeypatch.setenv("OFFLOAD_TUNER_RAM", "96GiB")
    assert hardware(None, "24GiB").host.ram_bytes == 96 * GiB
    profile = load_hardware("server-12ch-ddr5")
    assert hardware("server-12ch-ddr5", None).host.ram_bytes == profile.host.ram_bytes
    assert hardware("server-12ch-ddr5", "24GiB").host.ram_bytes == profile.host.ram_bytes
    assert hardware("server-12ch-ddr5", None, ram="1TiB").host.ram_bytes == 1 << 40
    assert hardware(None, "24GiB", ram="48GiB").host.ram_bytes == 48 * GiB
    monkeypatch.delenv("OFFLOAD_TUNER_RAM")
    import os
    here = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert machine_ram_bytes() == here == hardware(None, "24GiB").host.ram_bytes


def test_every_request_takes_ram_alike():
    from offload_tuner.service import bodies
    from offload_tuner.service.security import PathPolicy
    paths = PathPolicy(())
    for command, cls in (("plan", PlanRequest), ("explain", ExplainRequest), ("tune", TuneRequest)):
        body = {"model": QWEN, "ram": "64GiB", **({"args": ["-ngl", "99"]} if command == "explain" else {})}
        req = bodies.request(command, body, paths)
        assert isinstance(req, cls) and req.ram == "64GiB"
        assert "ram" in bodies.schema(command)["properties"]
    assert "--ram=64GiB" in TuneRequest(QWEN, ram="64GiB").to_argv()


def test_cache_ram_is_written_only_where_the_build_has_it():
    inv = load_model(QWEN)
    hw = from_gpu_sizes("16GiB")
    for dialect, old in (("mainline", 6000), ("ik", 3900)):
        plan = propose(inv, hw, dialect=dialect)[0]
        line = render(plan, inv, "server", cache_ram_mib=4096)
        assert list(line.argv[-2:]) == ["--cache-ram", "4096"] and parse(line, inv, dialect).cache_ram_mib == 4096
        build = parse_build(f"{dialect}:{old}", dialect)
        assert "--cache-ram" not in render(plan, inv, "server", cache_ram_mib=4096, build=build).argv
        assert "--cache-ram" not in render(plan, inv, "cli", cache_ram_mib=4096).argv
    assert parse(["-ngl", "99", "-cram", "-1"], inv, "mainline").cache_ram_mib == -1
    assert parse(["-ngl", "99"], inv, "mainline").cache_ram_mib is None


def test_the_prompt_cache_takes_what_is_left():
    bill = HostBill(ram=64 * GiB, weights_mapped=60 * GiB, weights_pinned=0, kv=GiB, compute=0, process=0)
    assert bill.left == 3 * GiB and cache_ram_for(bill) == 3072 and bill.disk_share == 0
    assert cache_ram_for(replace(bill, ram=128 * GiB)) == DEFAULT_CACHE_RAM_MIB
    over = replace(bill, ram=31 * GiB)
    assert over.shortfall == 30 * GiB and over.disk_share == pytest.approx(0.5) and cache_ram_for(over) == 0


# ---- tune ---------------------------------------------------------------------------------------------------------

def test_tune_refuses_in_one_line_when_no_config_fits_the_ram(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OFFLOAD_TUNER_RAM", "128GiB")         # --gpu alone: this machine's RAM
    assert cli.main(["tune", DEEPSEEK, "--gpu", "24GiB", "--engine", "sim", "--trials", "3", "--no-report",
                     "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "nothing fits in host RAM" in err and "128.00 GiB of RAM" in err
    # a profile's own RAM, the same
    profile = json.loads(json.dumps(load_hardware("desktop-ddr5").to_dict()))
    profile["host"]["ram_bytes"] = 128 * GiB
    (tmp_path / "small.json").write_text(json.dumps(profile))
    assert cli.main(["tune", DEEPSEEK, "--hardware", "small.json", "--engine", "sim", "--trials", "3",
                     "--no-report", "--quiet"]) == 2
    assert "nothing fits in host RAM" in capsys.readouterr().err


def test_ram_floor_is_a_lower_bound_of_every_placement():
    inv = load_model(DEEPSEEK)
    hw = from_gpu_sizes("24GiB").with_ram(128 * GiB)
    floor = ram_floor(inv, hw)
    for plan in propose(inv, hw):
        assert host_bill(estimate(inv, plan, hw), hw.host.ram_bytes).need >= floor
    from tuner.search import Tuner, StudyConfig
    from runtime.sim import SimEngine
    with pytest.raises(BudgetError, match="nothing fits in host RAM"):
        Tuner(inv, hw, SimEngine(hw), StudyConfig(objective="tg", storage=None))


def test_a_config_whose_weights_in_ram_do_not_fit_is_over_budget():
    from tuner.space import Space
    inv = load_model(DEEPSEEK)
    hw = from_gpu_sizes("24GiB")
    plans = propose(inv, hw)
    bills = [host_bill(estimate(inv, p, hw), 0) for p in plans]
    small, big = min(bills, key=lambda b: b.need), max(bills, key=lambda b: b.need)
    assert big.need > small.need
    ram = (small.need + big.need) // 2            # the fullest GPU placement fits, experts all in RAM does not
    space = Space(inv, hw.with_ram(ram))
    reasons = {b.need: space.over_budget(estimate(inv, p, hw)) for p, b in zip(plans, bills)}
    assert reasons[small.need] == ""
    assert reasons[big.need].startswith("host RAM: needs") and "of weights in RAM" in reasons[big.need]


def test_a_sim_study_picks_only_configs_that_fit_the_ram_and_reports_the_host_row(tmp_path, monkeypatch):
    from offload_tuner.app.tune import start_tune
    inv = load_model(DEEPSEEK)
    hw = from_gpu_sizes("24GiB")
    need = min(host_bill(estimate(inv, p, hw), 0).need for p in propose(inv, hw))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OFFLOAD_TUNER_RAM", str(need + 2 * GiB))       # room for the fullest placements only
    out = start_tune(TuneRequest(DEEPSEEK, gpu="24GiB", trials=6, pool=20, objective="tg", quiet=True,
                                 out=str(tmp_path / "report")))
    best = out.summary.best["tg"]
    assert best["host"]["weights_mapped"] + best["host"]["weights_pinned"] <= need + 2 * GiB
    md = (tmp_path / "report" / "summary.md").read_text()
    assert "host RAM" in md and "(predicted)" in md and "--cache-ram" in best["commands"]["llama-server"]
