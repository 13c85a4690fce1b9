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
    # the check (--full, implied by --cpu): the same study's serving on a copy, every contender 3 rounds, none
    # dropped, going on from the quick path's rows; its verdict judged by tuner.served.same_verdict
    import optuna

    from tuner.records import StudyRecord
    from tuner.served import same_verdict
    full = StudyRecord.of(optuna.load_study(study_name="1-agent",
                                            storage=f"sqlite:///{tmp_path / 'full-1-agent.db'}")).served
    study = optuna.load_study(study_name="1-agent", storage=f"sqlite:///{tmp_path / 'time_to_answer.db'}")
    quick, rows = StudyRecord.of(study).served, StudyRecord.of(study).serving["rows"]
    assert all(len(r["request_s"]["samples"]) == 3 and not r["dropped"] for r in full["results"]), full["results"]
    assert cell["full_pick"] == full["pick"] and cell["full_runs"] == 3 * len(full["results"])
    assert cell["same_verdict"] is same_verdict(cell["pick"], full) and isinstance(cell["same_verdict"], bool)
    # the quick path served less: what it left out is said and none of it ran later
    assert quick["thrift"]["repetitions"] == 1 and cell["served_runs"] < cell["full_runs"]
    for r in quick["results"]:          # a dropped contender has no row after the round it was dropped in
        if r["dropped"]:
            last = 1 if r["dropped_why"].endswith("after its first") else int(r["dropped_why"].rsplit(" ", 1)[1])
            assert max(x["round"] for x in rows if x["key"] == r["key"]) < last, (r, rows)
    assert subprocess.run(["pgrep", "-x", "llama-server"], capture_output=True).returncode == 1   # none left
