"""One meaning of --gpu (the card's memory) and one headroom rule (issue 29, item 2): every command and the service
keep --keep-free (default 1024 MiB, llama.cpp's own -fitt default) free on each GPU, for the sim engine as for real
ones, and say so ("kept free: N MiB"); plan and tune hold a config to the same room."""
from __future__ import annotations

import json
from dataclasses import fields

import pytest

from offload_tuner import cli
from planner import defaults as D
from offload_tuner.app.requests import DEMO, PlanRequest, TuneRequest
from planner.flags.interpret import FIT_TARGET_MIB
from planner.hardware import KEEP_FREE, MiB, GiB, load_hardware
from planner.propose import Room
from tuner.options import Settings, hardware_key

MODEL = "preset:Qwen3-30B-A3B:Q4_K_M"
GPU = ["--hardware", "rtx4090-ddr5", "--gpu", "16GiB"]


def _default(cls: type, name: str) -> str:
    return next(f.default for f in fields(cls) if f.name == name)


def test_one_default_everywhere_is_what_llama_cpps_fit_keeps_free():
    assert KEEP_FREE == FIT_TARGET_MIB * MiB == 1024 * MiB
    assert _default(PlanRequest, "keep_free") == _default(TuneRequest, "keep_free") == D.KEEP_FREE == "1024MiB"
    assert DEMO.keep_free == D.KEEP_FREE          # the demo, and the service (it takes the same requests)


def test_the_service_takes_the_same_default_and_flag():
    from offload_tuner.service import bodies
    from offload_tuner.service.security import PathPolicy
    paths = PathPolicy(())
    assert bodies.request("plan", {"model": MODEL}, paths).keep_free == D.KEEP_FREE
    assert bodies.request("tune", {"model": MODEL}, paths).keep_free == D.KEEP_FREE
    assert bodies.request("tune", {"model": MODEL, "keep_free": "0"}, paths).keep_free == "0"


def test_the_room_is_the_cards_memory_less_what_is_kept_free():
    # 16 GiB card, 1 GiB kept free, a 256 MiB margin for the memory model's error: 14.75 GiB to place tensors in
    hw = load_hardware("rtx4090-ddr5").with_vram([16 * GiB])
    assert Room.from_hardware(hw, 0).gpus == {"CUDA0": 16 * GiB}          # built in code: nothing kept free
    from dataclasses import replace
    kept = replace(hw, keep_free_bytes=KEEP_FREE)
    assert Room.from_hardware(kept, 256 * MiB).gpus == {"CUDA0": 16 * GiB - 1024 * MiB - 256 * MiB}
    assert "keep_free_bytes" not in kept.to_dict()          # a profile's JSON is the machine's, not a command's


def test_a_study_stored_before_keep_free_resumes_with_it():
    from dataclasses import replace
    hw = replace(load_hardware("rtx4090-ddr5"), keep_free_bytes=KEEP_FREE)
    s = Settings(model="m", model_id="m", engine="sim", hardware=hardware_key(hw), dialect="mainline",
                 objective="tg", n_ctx=8192, space={})
    old = {k: v for k, v in s.to_dict().items()}
    old["hardware"] = {k: v for k, v in old["hardware"].items() if k != "keep_free"}
    assert s.differences(Settings.from_dict(old)) == []
    assert s.differences(Settings.from_dict({**old, "hardware": {**old["hardware"], "keep_free": 0}})) == ["hardware"]


def test_plan_and_tune_hold_a_config_to_the_same_room(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", MODEL, *GPU, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["keep_free_bytes"] == 1024 * MiB and plan["budgets"] == {"CUDA0": 15 * GiB}
    assert plan["devices"]["CUDA0"]["total"] <= 15 * GiB
    assert cli.main(["plan", MODEL, *GPU]) == 0
    assert "kept free: 1024 MiB per GPU" in capsys.readouterr().out

    url = f"sqlite:///{tmp_path / 'k.db'}"
    argv = ["tune", MODEL, "--engine", "sim", *GPU, "--trials", "4", "--pool", "20", "--objective", "both",
            "--study", "k", "--storage", url, "--quiet", "--no-report"]
    assert cli.main([*argv, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["budget_bytes"] == sum(plan["budgets"].values()) and s["keep_free_bytes"] == 1024 * MiB
    assert s["settings"]["hardware"]["keep_free"] == 1024 * MiB
    for r in s["best"].values():
        assert r["vram_bytes"] <= 15 * GiB
    assert cli.main([*argv, "--trials", "1"]) == 0          # resumes, and says what it keeps free
    assert "budget: 15.00 GiB of GPU memory (kept free: 1024 MiB per GPU)" in capsys.readouterr().out


def test_keep_free_zero_gives_the_whole_card_and_a_bad_one_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["plan", MODEL, *GPU, "--keep-free", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budgets"] == {"CUDA0": 16 * GiB}
    for bad in ("lots", "-1GiB"):
        assert cli.main(["plan", MODEL, *GPU, f"--keep-free={bad}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("offload-tuner: error: bad size") and "\n" not in err
    assert cli.main(["tune", MODEL, "--gpu", "1GiB", "--keep-free", "1GiB", "--no-report"]) == 2
    assert "nothing fits on CUDA0: --keep-free 1GiB keeps all of its 1.00 GiB free" in capsys.readouterr().err
    assert cli.main(["tune", MODEL, "--gpu", "1GiB", "--keep-free", "600MiB", "--trials", "1", "--no-report"]) == 2
    assert "minus 600.00 MiB kept free" in capsys.readouterr().err
    assert not (tmp_path / "studies").exists()


@pytest.mark.slow
def test_the_demos_pick_leaves_the_headroom(tmp_path, capsys, monkeypatch):
    # the demo's 16 GiB card: its picks stay 1024 MiB under it (they filled it to within 5 MiB before)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--trials", "10", "--pool", "40", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "kept free: 1024 MiB" in out
    s = json.loads((tmp_path / "reports" / "demo" / "report.json").read_text())
    assert s["budget_bytes"] == 15 * GiB
    for r in [*s["best"].values(), *s["pareto"]]:
        assert r["vram_bytes"] <= 15 * GiB, r
    assert "kept free: 1024 MiB per GPU" in (tmp_path / "reports" / "demo" / "summary.md").read_text()


def test_explain_judges_the_whole_card(capsys):
    # explain says what llama.cpp does with the card as declared: a 1 GiB card is one, not "nothing fits"
    assert cli.main(["explain", MODEL, "--gpu", "1GiB", "--json", "--", "-ngl", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]
