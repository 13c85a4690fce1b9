"""A split model named by any of its shards: every emitted -m names the first shard, since llama.cpp loads a split
only from it ("model must be loaded with the first split", src/llama-model-loader.cpp). Issue 40, item 4."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

from offload_tuner import cli
from planner.gguf_header import first_shard
from planner.loader import load_model
from planner.options import EngineOptions


def _five_shards(tmp_path: Path, capsys) -> list[Path]:
    """tiny qwen3moe written by `offload-tuner synth --split-max` in 5 shards (sparse: nothing reads the data)."""
    for kib in range(600, 2000, 40):
        out = tmp_path / f"ds{kib}.gguf"
        assert cli.main(["synth", "--tiny", "--arch", "qwen3moe", "--sparse", "--quiet", "--split-max", f"{kib}KiB",
                         "--out", str(out)]) == 0
        paths = [Path(p) for p in capsys.readouterr().out.split()]
        if len(paths) == 5:
            return paths
    raise AssertionError("no --split-max gives 5 shards")


def _m(line: str) -> str:
    argv = shlex.split(line)
    return argv[argv.index("-m") + 1]


def test_plan_from_shard_3_of_5_emits_the_first_shard(tmp_path, capsys):
    paths = _five_shards(tmp_path, capsys)
    third = paths[2]
    assert third.name.endswith("-00003-of-00005.gguf")
    assert cli.main(["plan", str(third), "--gpu", "24GiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for tool in ("llama-server", "llama-cli", "llama-bench"):
        assert _m(out["commands"][tool]) == str(paths[0]), tool
        assert _m(out["commands"][tool]).endswith("-00001-of-00005.gguf")
    assert cli.main(["plan", str(third), "--gpu", "24GiB"]) == 0          # the text lines say the same
    text = capsys.readouterr().out
    assert f"-m {paths[0]}" in text and "-00003-of-00005" not in text
    # the engines (tune's and run's measured runs) and the inventory's source get the first shard too
    assert EngineOptions("llamacpp", str(third)).model_path == str(paths[0])
    assert load_model(str(third)).source == str(paths[0])


def test_first_shard_keeps_the_folder_as_written_and_leaves_other_names():
    assert first_shard("models/ds-00003-of-00005.gguf") == "models/ds-00001-of-00005.gguf"
    assert first_shard("ds-00005-of-00005.gguf") == "ds-00001-of-00005.gguf"
    assert first_shard("ds-00001-of-00005.gguf") == "ds-00001-of-00005.gguf"
    assert first_shard("/m/Qwen3-30B-A3B-Q4_K_M.gguf") == "/m/Qwen3-30B-A3B-Q4_K_M.gguf"
    assert first_shard("ds-3-of-5.gguf") == "ds-3-of-5.gguf"          # not gguf-split's name: as given
