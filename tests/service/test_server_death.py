"""A tune worker dies with the server that started it, kill -9 of the server included (planner/children.py: the
kernel sends the worker SIGINT, the stop that keeps a study resumable): nothing is left running, no trial is left
RUNNING, and the study resumes."""
from __future__ import annotations

import sys
import time

import pytest

from serving import HW, MODEL, cli, env, free_port
from survivors import kill_all, marked, new_mark, survivors

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


@pytest.mark.slow
def test_kill_9_of_the_server_stops_its_tune_workers(tmp_path):
    import subprocess

    import httpx
    import optuna
    mark = new_mark()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "offload_tuner.cli", "serve", "--host", "127.0.0.1", "--port",
                               str(port)], cwd=tmp_path, env={**env(), **mark}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/api/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and server.poll() is None, "serve did not start"
            time.sleep(0.2)
        r = httpx.post(url + "/api/tunes", json={"model": MODEL, **HW, "trials": 200, "study": "w"}, timeout=60)
        assert r.status_code == 202, r.text
        worker = r.json()["pid"]
        db = tmp_path / "studies" / "w.db"
        deadline = time.monotonic() + 120          # some trials finished: the study is under way
        while not (db.exists() and _finished(db) >= 3):
            assert time.monotonic() < deadline and worker in marked(mark), "the worker ran no trial"
            time.sleep(0.2)
        server.kill()
        server.wait(10)
        left = survivors(mark, wait_s=30)
        assert not left, f"left running after kill -9 of serve: {left}"
        trials = optuna.load_study(study_name="w", storage=f"sqlite:///{db}").get_trials(deepcopy=False)
        assert not [t.number for t in trials if t.state == optuna.trial.TrialState.RUNNING]
        before = _finished(db)
        assert before < 200
        cli("tune", MODEL, "--engine", "sim", "--hardware", HW["hardware"], "--gpu", HW["gpu"], "--trials", "2",
            "--study", "w", "--storage", f"sqlite:///{db}", "--no-report", "--quiet", cwd=tmp_path)
        assert _finished(db) > before
    finally:
        kill_all([server.pid, *marked(mark)])


def _finished(db) -> int:
    import optuna
    try:
        trials = optuna.load_study(study_name="w", storage=f"sqlite:///{db}").get_trials(deepcopy=False)
    except Exception:            # not created yet, or its tables are being made
        return 0
    return sum(t.state.is_finished() for t in trials)
