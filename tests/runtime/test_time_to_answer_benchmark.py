"""benchmarks/time_to_answer.py's CPU dry run (the tiny model, the CPU llama-bench and llama-server): the user's
tune command runs to a recommendation, its lines are kept, and the report names its figures."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]


def _run(workdir: Path, budget: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "time_to_answer.py"), "--cpu", "--cells",
                           "1:agent", "--workdir", str(workdir), "--budget-s", str(budget), "--out",
                           str(workdir / "out")], capture_output=True, text=True, timeout=600)


def test_the_dry_run_gives_a_recommendation_and_its_figures(tmp_path, llama_bench, llama_server):
    r = _run(tmp_path, 300)
    assert r.returncode == 0, r.stdout + r.stderr
    cell = json.loads((tmp_path / "out" / "time_to_answer.json").read_text())["cells"][0]
    assert cell["done"] and cell["calls"] == 1 and cell["wall_s"] > 0
    assert cell["pick"] and cell["headline"].startswith("agent: ") and cell["served_runs"] > 0
    assert cell["served_lines"] == cell["served_runs"]             # a line per server run
    assert cell["threads"].startswith("threads: llama.cpp's default -t generated ")
    assert len(cell["threads_probe_lines"]) >= 3
    assert "| 1:agent |" in (tmp_path / "out" / "time_to_answer.md").read_text()
