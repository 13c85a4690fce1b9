"""The rows of samples a study stores (the llama-bench confirmation's, the served stage's) are typed in the tuner
(tuner.records ConfirmSample, ServedRun) and written back exactly as they were stored: the keys a row has, in its
order, a key an older offload-tuner did not write still absent."""
from __future__ import annotations

import json

import pytest

from tuner.records import ConfirmSample, ServedRun

SERVED_NOW = {"round": 1, "key": "trial:3", "machine": "boot-1", "threads": 8, "ok": True, "error": "",
              "request_s": 4.2, "ttft_s": 0.9, "ttft_max_s": 1.4, "pp_tps": 900.5, "tg_tps": 41.0,
              "peak_bytes": {"CUDA0": 6 << 30}, "command": "llama-server -m m.gguf", "seconds": 61.0, "ready_s": 12.0}
SERVED_OLD = {"round": 0, "key": "fit:512", "ok": True, "error": "", "request_s": 5.0, "ttft_s": 1.0,
              "pp_tps": 800.0, "tg_tps": 40.0, "peak_bytes": {"CUDA0": 5 << 30}, "command": "llama-server --fit on",
              "seconds": 70.0}                  # before machine, threads, ttft_max_s and ready_s were kept
SERVED_FAILED = {"round": 0, "key": "trial:1", "machine": "boot-1", "ok": False, "error": "engine raised X: y"}
CONFIRM = {"round": 2, "key": "fit", "ok": True, "tg_tps": 50.1, "pp_tps": 3000.0, "error": "",
           "peak_bytes": {"CUDA0": 1 << 30}, "cv": 0.01, "seen": ""}


@pytest.mark.parametrize("row", [SERVED_NOW, SERVED_OLD, SERVED_FAILED], ids=["now", "old", "failed"])
def test_a_served_row_writes_back_as_stored(row):
    r = ServedRun.from_dict(row)
    assert json.dumps(r.to_dict()) == json.dumps(row)       # the same keys, in the same order
    assert r.key == row["key"] and r.ok is row["ok"]


def test_a_row_without_the_newer_keys_reads_as_not_known():
    old = ServedRun.from_dict(SERVED_OLD)
    assert old.machine is None and old.threads is None and old.ttft_max_s is None and old.ready_s is None
    assert old.request_s == 5.0 and old.peak_bytes == {"CUDA0": 5 << 30}
    failed = ServedRun.from_dict(SERVED_FAILED)
    assert failed.request_s is None and failed.peak_bytes is None and "request_s" not in failed.to_dict()
    # a row made in code has every field unless it says otherwise
    assert set(ServedRun(round=0, key="k").to_dict()) == set(SERVED_NOW)


def test_a_confirmation_row_writes_back_as_stored():
    r = ConfirmSample.from_dict(CONFIRM)
    assert json.dumps(r.to_dict()) == json.dumps(CONFIRM)
    assert (r.tg_tps, r.cv, r.peak_bytes) == (50.1, 0.01, {"CUDA0": 1 << 30})
    assert ConfirmSample.from_dict({"round": 0, "key": "fit", "ok": False, "error": "x"}).to_dict() == {
        "round": 0, "key": "fit", "ok": False, "error": "x"}
