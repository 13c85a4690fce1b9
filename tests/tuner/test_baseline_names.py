"""A baseline is named by the placement flags its command carries (issue 40 item 11): `-ngl 99 -cmoe` on a
2-layer model is emitted `-ngl 3 -cmoe` (the layers and the output layer), and the report showed the one beside
the other."""
from __future__ import annotations

import shlex

from planner.gguf_header import load_inventory
from planner.hardware import GiB, load_hardware
from runtime.sim import SimEngine
from runtime.synth import tiny_spec, uniform_recipe, write_gguf
from tuner.search import BenchRun, StudyConfig, Tuner


def _tuner(tmp_path, n_gpus: int, dialect: str) -> Tuner:
    model = tmp_path / "tiny-moe.gguf"
    write_gguf(model, tiny_spec("qwen3moe"), uniform_recipe("Q8_0", None))
    inv = load_inventory(model)
    hw = load_hardware("rtx4090-ddr5").with_vram([1 * GiB] * n_gpus)
    return Tuner(inv, hw, SimEngine(hw), StudyConfig(model=str(model), objective="tg", bench=BenchRun(64, 16, 0, 1),
                                                     dialect=dialect, storage=f"sqlite:///{tmp_path / 's.db'}",
                                                     study_name="names", pool_size=10, seed=1))


def _placement(cmd: str) -> list[str]:
    argv = shlex.split(cmd)
    keep = {"-ngl": 2, "-ts": 2, "-ot": 2, "-cmoe": 1, "-ncmoe": 2}
    out, i = [], 0
    while i < len(argv):
        n = keep.get(argv[i], 0)
        out += argv[i:i + n]
        i += n or 1
    return out


def test_each_baseline_is_named_as_its_command_says(tmp_path):
    t = _tuner(tmp_path, 1, "mainline")
    base = {b["kind"]: b for b in t.baselines()}
    # qwen3moe's tiny spec has 2 layers: every layer and the output layer on the GPU is -ngl 3
    assert base["cmoe"]["name"] == "-ngl 3 -cmoe"
    assert " -ngl 3 -cmoe " in base["cmoe"]["commands"]["llama-server"]
    for b in (base["cmoe"], base["ncmoe"]):         # the fill and --fit are named by what they are
        if b.get("plan"):
            assert shlex.split(b["name"]) == _placement(b["commands"]["llama-server"]), b["name"]


def test_a_resumed_study_does_not_measure_the_renamed_baseline_again(tmp_path):
    t = _tuner(tmp_path, 1, "mainline")
    first = t.baselines()
    again = _tuner(tmp_path, 1, "mainline").baselines()
    assert [b["name"] for b in again] == [b["name"] for b in first]


def test_ik_on_two_gpus_names_the_override_it_emits(tmp_path):
    base = {b["kind"]: b for b in _tuner(tmp_path, 2, "ik").baselines()}
    cmoe = base["cmoe"]
    assert cmoe["name"].startswith("-ngl 3 -ts ") and cmoe["name"].endswith("-ot exps=CPU"), cmoe["name"]
    assert shlex.split(cmoe["name"]) == _placement(cmoe["commands"]["llama-server"])
