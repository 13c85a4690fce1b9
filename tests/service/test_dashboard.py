"""optuna-dashboard opens a study written by `tune` (SQLite, as tune writes it) and shows its trials, with the
objectives named (tune sets Optuna's metric names; without them the dashboard says 'Objective 0/1')."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx

from serving import STUDY, env, free_port


def test_optuna_dashboard_reads_a_tune_study(server):
    with server.client() as c:
        ours = c.get(f"/api/studies/{STUDY}").json()
    port = free_port()
    db = server.workdir / "studies" / f"{STUDY}.db"
    proc = subprocess.Popen([sys.executable, "-m", "optuna_dashboard._cli", f"sqlite:///{db}", "--host", "127.0.0.1",
                             "--port", str(port)], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while True:
            try:
                r = httpx.get(f"{url}/api/studies", timeout=5)
                break
            except httpx.HTTPError as e:
                if time.time() > deadline or proc.poll() is not None:
                    why = proc.stdout.read().decode()[-2000:] if proc.poll() is not None else "no answer"
                    raise AssertionError(why) from e
                time.sleep(0.3)
        assert r.status_code == 200
        summary = next(s for s in r.json()["study_summaries"] if s["study_name"] == STUDY)
        assert summary["directions"] == ["maximize", "maximize"]
        d = httpx.get(f"{url}/api/studies/{summary['study_id']}?after=0", timeout=60).json()
        assert len(d["trials"]) == ours["n_trials"]
        assert d["objective_names"] == ["tg_tps", "pp_tps"]
        complete = [t for t in d["trials"] if t["state"] == "Complete"]
        assert complete and all(len(t["values"]) == 2 for t in complete)
        assert {"candidate", "measured", "source"} <= {a["key"] for a in d["union_user_attrs"]}
        assert d["best_trials"]
        page = httpx.get(f"{url}/dashboard/studies/{summary['study_id']}", timeout=30)
        assert page.status_code == 200 and "Optuna Dashboard" in page.text
    finally:
        proc.terminate()
        proc.wait(timeout=20)
