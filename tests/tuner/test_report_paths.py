"""Reports name files relative to the study (issue 40 item 10): the model by its file name, llama.cpp's programs
by theirs; the study keeps the paths it resumes with."""
from __future__ import annotations

import json

from planner.gguf_header import load_inventory
from planner.hardware import GiB, load_hardware
from runtime.sim import SimEngine
from runtime.synth import tiny_spec, uniform_recipe, write_gguf
from tuner.records import StudyRecord
from tuner.report import shown_paths, write_study_report
from tuner.search import BenchRun, StudyConfig, Tuner


def test_a_report_carries_no_path_of_the_machine_that_made_it(tmp_path):
    models = tmp_path / "deep" / "models"
    models.mkdir(parents=True)
    model = models / "tiny-moe.gguf"
    write_gguf(model, tiny_spec("qwen3moe"), uniform_recipe("Q8_0", None))
    inv = load_inventory(model)
    hw = load_hardware("rtx4090-ddr5").with_vram([1 * GiB])
    t = Tuner(inv, hw, SimEngine(hw), StudyConfig(model=str(model), objective="tg", bench=BenchRun(64, 16, 0, 1),
                                                 storage=f"sqlite:///{tmp_path / 's.db'}", study_name="paths",
                                                 pool_size=10, seed=1))
    t.run(3)
    assert StudyRecord.of(t.study).settings.model == str(model)       # the study keeps the path it resumes with
    out = tmp_path / "rep"
    summary = write_study_report(t.study, out)
    texts = {f: (out / f).read_text() for f in ("summary.md", "summary.html", "report.json", "trials.csv")}
    for name, text in texts.items():
        assert str(tmp_path) not in text, name
    assert "llama-server -m tiny-moe.gguf" in texts["trials.csv"]                # a command to paste where it is
    assert json.loads(texts["report.json"])["files"][0] == "trials.csv"
    assert summary.files[0] == str(out / "trials.csv")                       # the caller is told where they went


def test_programs_and_shards_by_their_names():
    model = "/data/m/DeepSeek-00001-of-00003.gguf"
    text = ("llama-server -m /data/m/DeepSeek-00001-of-00003.gguf; shard /data/m/DeepSeek-00002-of-00003.gguf; "
            "`/home/u/llama.cpp/build/bin/llama-server --port 1`, /opt/ik/bin/llama-sweep-bench -c 9")
    assert shown_paths(text, model) == ("llama-server -m DeepSeek-00001-of-00003.gguf; shard "
                                        "DeepSeek-00002-of-00003.gguf; `llama-server --port 1`, llama-sweep-bench -c 9")
    assert shown_paths("preset model, /usr/bin/python3", "preset:Qwen3-30B-A3B") == "preset model, /usr/bin/python3"
