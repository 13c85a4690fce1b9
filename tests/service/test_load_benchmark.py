"""benchmarks/service_load.py's whole path, briefly (6 clients, 3 s, a study beside them and alone), so that the
benchmark cannot rot: every endpoint asked and answered, the study's trials counted, both reports written."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_the_load_benchmark_runs(bench_script, tmp_path):
    service_load = bench_script("service_load")
    service_load.main(["--clients", "6", "--seconds", "3", "--think", "0.5", "--out", str(tmp_path)])
    f = json.loads((tmp_path / "service_load.json").read_text())
    assert set(f["endpoints"]) == set(service_load.ENDPOINTS)
    for name, e in f["endpoints"].items():
        assert e["requests"] >= 1 and e["errors"] == 0, (name, e)
    assert f["study_quiet"]["trials"] >= 1 and f["study_loaded"]["window_s"] >= 3
    assert f["server_rss_peak_bytes"] > 0 and f["server_tracebacks"] == 0
    assert "| plan |" in (tmp_path / "service_load.md").read_text()
