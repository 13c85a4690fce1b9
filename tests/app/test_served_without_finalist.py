"""A tune whose search finished no run (its --time-limit's first half spent on the thread probe and the baselines,
as 8 GiB rag took on an H200 at --time-limit 7m) still serves --fit's variants on llama-server: that verdict is the
answer, so the tune ends well and says why only --fit was compared; without a served verdict the cause stays the
error it was (exit 2)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from offload_tuner.app.requests import TuneRequest
from offload_tuner.app.tune import check_some_ran
from planner.errors import InputError
from planner.gguf_header import load_inventory
from planner.hardware import GiB, load_hardware
from runtime.sim import SimEngine
from runtime.synth import tiny_spec, uniform_recipe, write_gguf
from tuner.records import ServedRun, StudyRecord
from tuner.search import BenchRun, StudyConfig, Tuner
from tuner.served import Served, served_record

MiB = 1 << 20


def _tuner(tmp_path) -> Tuner:
    model = tmp_path / "tiny-moe.gguf"
    write_gguf(model, tiny_spec("qwen3moe"), uniform_recipe("Q8_0", None))
    hw = load_hardware("rtx4090-ddr5").with_vram([1 * GiB])
    return Tuner(load_inventory(model), hw, SimEngine(hw), StudyConfig(
        model=str(model), objective="tg", bench=BenchRun(64, 16, 0, 1), storage=f"sqlite:///{tmp_path / 's.db'}",
        study_name="s", pool_size=10, seed=1))


def _fit_only_verdict() -> dict:
    refs = [Served("fit:512", "--fit", ("reference",), ubatch=512),
            Served("fit:4096", "--fit -ub 4096", ("reference",), ubatch=4096)]
    rows = [ServedRun.from_dict({"round": 0, "key": k, "ok": True, "request_s": s, "ttft_s": 1.0, "pp_tps": 900.0,
                                 "tg_tps": 50.0, "peak_bytes": {"CUDA0": 700 * MiB}})
            for k, s in (("fit:512", 10.6), ("fit:4096", 7.4))]
    return served_record(refs, rows, 1, {"CUDA0": 1024 * MiB}, "rag")


@pytest.mark.parametrize("served", [True, False], ids=["served", "not-served"])
def test_a_served_verdict_is_the_answer_of_a_search_that_finished_no_run(tmp_path, served):
    t = _tuner(tmp_path)
    if served:
        StudyRecord.save(t.study, served=_fit_only_verdict())
    req = TuneRequest(model="m.gguf", llama_server="llama-server", time_limit="7m")
    said: list[str] = []
    spent = time.monotonic() - 300        # past the search's half of 420 s

    def check() -> None:
        check_some_ran(req, t, SimpleNamespace(trials=1), 420.0, spent, "sqlite:///s.db", said.append)
    if served:
        check()
        assert said == ["# only --fit's variants were served: --time-limit 7m came before any run finished (1 "
                        "trials started); give a longer one: the same command goes on from what ran (sqlite:///s.db)"]
    else:
        with pytest.raises(InputError, match="--time-limit 7m came before any run finished"):
            check()
        assert said == []
    # without --llama-server a verdict stored earlier is no answer of this tune: the cause is the error
    with pytest.raises(InputError, match="came before any run finished"):
        check_some_ran(TuneRequest(model="m.gguf", time_limit="7m"), t, SimpleNamespace(trials=1), 420.0,
                       time.monotonic() - 500, "sqlite:///s.db", said.append)
