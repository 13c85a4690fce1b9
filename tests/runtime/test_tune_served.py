"""`tune --llama-server`: after the search, the finalists and llama-server's own --fit are served on the workload
(the real CPU llama-server, every plan on the CPU), and the study's JSON says first what it recommends."""
from __future__ import annotations

import json
import subprocess

from offload_tuner import cli
from runtime.synth import tiny_spec, uniform_recipe, write_gguf


def test_tune_serves_the_finalists_and_the_fit_references(tmp_path, llama_server, capsys):
    model = write_gguf(tmp_path / "tiny.gguf", tiny_spec("qwen3moe"), uniform_recipe("Q8_0"), vocab=True)[0]
    (tmp_path / "w.toml").write_text('name = "tiny"\n[[request]]\nnew_tokens = 32\ncached_tokens = 32\n'
                                     "gen_tokens = 8\n")
    argv = ["tune", str(model), "--gpu", "6GiB", "--workload", str(tmp_path / "w.toml"), "--trials", "3",
            "--pool", "10", "--storage", f"sqlite:///{tmp_path / 's.db'}", "--study", "s", "--no-report",
            "--llama-server", str(llama_server), "--cpu-stand-in", "--json", "--quiet"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out)[0] == "headline" and out["headline"].startswith("tiny: ")
    served = out["served"]
    assert served["workload"] == "tiny" and served["reference"].startswith("fit:") and served["pick"]
    keys = [r["key"] for r in served["results"]]
    assert keys[:3] == ["fit:512", "fit:2048", "fit:4096"] and any(k.startswith("trial:") for k in keys)
    assert all(r["request_s"]["samples"] for r in served["results"])          # 2 rounds, every server answered
    # one thread count for all, --fit too (the best finalist's): placement is compared, not -t
    threads = {r["command"].split(" -t ")[1].split()[0] for r in served["results"] if r.get("command")}
    assert len(threads) == 1 and int(threads.pop()) > 0, served["results"]
    assert subprocess.run(["pgrep", "-x", "llama-server"], capture_output=True).returncode == 1   # none left
    # serving needs the workload: another objective is one line, exit 2
    assert cli.main([*argv[:-2], "--objective", "tg", "--study", "s2"]) == 2
    assert "--llama-server serves the workload" in capsys.readouterr().err


def _served_rows(db) -> list[dict]:
    import optuna

    from tuner.records import StudyRecord
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{db}")
    return list((StudyRecord.of(study).serving or {}).get("rows", []))


def test_the_served_stage_says_each_run_resumes_after_kill_9_and_ends_by_its_time_limit(tmp_path, llama_server):
    """Issue 41 on the real CPU llama-server: a line per server run as it ends; kill -9 mid-stage loses no
    finished run and the same command goes on at the serving (nothing explored again, no run repeated); with a
    --time-limit already spent, the serving stops at once with its verdict so far marked partial, exit 0."""
    import os
    import signal
    import sys
    import time

    model = write_gguf(tmp_path / "tiny.gguf", tiny_spec("qwen3moe"), uniform_recipe("Q8_0"), vocab=True)[0]
    (tmp_path / "w.toml").write_text('name = "tiny"\n[[request]]\nnew_tokens = 32\ncached_tokens = 32\n'
                                     "gen_tokens = 8\n")
    db = tmp_path / "s.db"
    argv = [sys.executable, "-m", "offload_tuner.cli", "tune", str(model), "--gpu", "6GiB", "--workload",
            str(tmp_path / "w.toml"),
            "--trials", "3", "--pool", "10", "--storage", f"sqlite:///{db}", "--study", "s", "--no-report",
            "--llama-server", str(llama_server), "--cpu-stand-in"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    first, deadline = [], time.monotonic() + 300
    for line in proc.stderr:
        first.append(line)
        if line.startswith("# served 2:") or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert any(x.startswith("# served 1: ") for x in first) and first[-1].startswith("# served 2: "), first
    assert " round 1 of 2: loaded in " in first[-1] and " runs left, about " in first[-1]
    kept = _served_rows(db)
    assert len(kept) >= 2
    time.sleep(1)
    assert subprocess.run(["pgrep", "-x", "llama-server"], capture_output=True).returncode == 1   # none left

    def again(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([*argv, *extra], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    # a limit over before the first server run could start (at 0.5 s a loaded 2-core machine once had time for one)
    cut = again("--time-limit", "1ms")
    assert cut.returncode == 0, cut.stderr
    assert "# the search of this study is done: going on with its serving" in cut.stderr
    assert "# the --time-limit came before the serving's end: so far: tiny: partial" in cut.stderr, cut.stderr
    assert "# partial: run the same command to go on" in cut.stderr and "# served " not in cut.stderr
    assert _served_rows(db) == kept                                   # nothing served past the limit
    done = again()
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stderr.splitlines() if x.startswith("# served ")]
    assert lines and lines[0].startswith(f"# served {len(kept) + 1}: ")   # goes on from the stored rows
    assert "# tune " in done.stderr and "going on with its serving" in done.stderr
    rows = _served_rows(db)
    assert rows[:len(kept)] == kept and len(rows) == len(kept) + len(lines)
    assert len({(r["round"], r["key"]) for r in rows}) == len(rows)   # no run repeated
