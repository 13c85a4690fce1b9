"""What `report` prints and the web view's study data name the model by its file name (issue 40 item 10), as the
report's files do (tests/tuner/test_report_paths.py); the storage, where the study is, stays a path."""
from __future__ import annotations

import json

from offload_tuner import cli
from offload_tuner.service.studies import StudyStore
from runtime.synth import tiny_spec, uniform_recipe, write_gguf


def test_report_output_and_the_web_view_carry_no_path_of_this_machine(tmp_path, capsys):
    folder = tmp_path / "models" / "deep"
    folder.mkdir(parents=True)
    model = folder / "tiny-moe.gguf"
    write_gguf(model, tiny_spec("qwen3moe"), uniform_recipe("Q8_0", None))
    url = f"sqlite:///{tmp_path / 'studies.db'}"
    assert cli.main(["tune", str(model), "--engine", "sim", "--hardware", "rtx4090-ddr5", "--gpu", "4GiB",
                     "--objective", "tg", "--trials", "3", "--pool", "10", "--storage", url, "--study", "p",
                     "--no-report", "--quiet"]) == 0
    capsys.readouterr()
    assert cli.main(["report", "p", "--storage", url, "--out", str(tmp_path / "rep")]) == 0
    text = capsys.readouterr().out
    assert "llama-server -m tiny-moe.gguf" in text and str(folder) not in text, text
    assert cli.main(["report", "p", "--storage", url, "--out", str(tmp_path / "rep"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["settings"]["model"] == "tiny-moe.gguf" and d["storage"] == url
    assert str(folder) not in json.dumps({k: v for k, v in d.items() if k != "storage"})
    web = StudyStore(url, tmp_path).detail("p")
    assert web["settings"]["model"] == "tiny-moe.gguf" and web["trials"]
    assert str(folder) not in json.dumps({k: v for k, v in web.items() if k != "storage"}, default=str)
    assert web["trials"][0]["llama-server"].startswith("llama-server -m tiny-moe.gguf ")
