"""The JSON API against the real server on a loopback port: the same JSON as the CLI's --json, the same one-line
errors (4xx, never a traceback), the server's configuration out of a request's reach, tunes in workers."""
from __future__ import annotations

import json
import os
import signal

import pytest

from offload_tuner.cli import main

from serving import HW, MODEL, STUDY, cli, events, start_server, wait_job


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_explain_inspect_match_the_cli(server, capsys):
    with server.client() as c:
        r = c.post("/api/plan", json={"model": MODEL, "gpu": "16GiB", "ctx": 8192, "objective": "both"})
        assert r.status_code == 200, r.text
        rc, out, _ = run_cli(capsys, "plan", MODEL, "--gpu", "16GiB", "--ctx", "8192", "--objective", "both", "--json")
        assert rc == 0 and r.json() == json.loads(out)
        args = ["llama-server", "-m", "x.gguf", "-ngl", "99", "-ot", "blk\\.(1|2|3)\\.ffn.*=CPU", "-ot", "exps=CPU",
                "-c", "32768", "-ub", "4096", "-nkvo"]
        r = c.post("/api/explain", json={"model": "preset:gpt-oss-120b", "gpu": "24GiB", "args": args})
        assert r.status_code == 200, r.text
        rc, out, _ = run_cli(capsys, "explain", "preset:gpt-oss-120b", "--gpu", "24GiB", "--json", "--", *args)
        assert rc == 0 and r.json() == json.loads(out)
        assert any(w.startswith("W004") for w in r.json()["warnings"])
        r = c.post("/api/inspect", json={"model": MODEL})
        rc, out, _ = run_cli(capsys, "inspect", MODEL, "--json")
        assert r.status_code == 200 and r.json() == json.loads(out)


BAD = [   # (command, body, the same on the command line)
    ("plan", {"model": MODEL, "gpu": "16GXB"}, ["plan", MODEL, "--gpu", "16GXB"]),
    ("plan", {"model": MODEL, "gpu": "16GiB", "ctx": "abc"}, ["plan", MODEL, "--gpu", "16GiB", "--ctx", "abc"]),
    ("plan", {"model": MODEL, "gpu": "16GiB", "ctx": -5}, ["plan", MODEL, "--gpu", "16GiB", "--ctx=-5"]),
    ("plan", {"model": "preset:Nope-7B", "gpu": "16GiB"}, ["plan", "preset:Nope-7B", "--gpu", "16GiB"]),
    ("plan", {"model": MODEL}, ["plan", MODEL]),
    ("plan", {"model": MODEL, "gpu": "16GiB", "dialect": "vllm"},
     ["plan", MODEL, "--gpu", "16GiB", "--dialect", "vllm"]),
    ("explain", {"model": "preset:gpt-oss-120b", "args": ["-ngl", "99", "-ot", "blk\\.(1|2|3),ffn.*=CPU"]},
     ["explain", "preset:gpt-oss-120b", "--", "-ngl", "99", "-ot", "blk\\.(1|2|3),ffn.*=CPU"]),
    ("explain", {"model": MODEL, "gpu": "16GiB", "args": ["-ngl", "99", "-ot", "exps=CUDA3"]},
     ["explain", MODEL, "--gpu", "16GiB", "--", "-ngl", "99", "-ot", "exps=CUDA3"]),
    ("explain", {"model": MODEL, "args": []}, ["explain", MODEL]),
]


@pytest.mark.parametrize("command,body,argv", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_the_clis_one_line(server, capsys, command, body, argv):
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and err.count("\n") == 1
    with server.client() as c:
        r = c.post(f"/api/{command}", json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {"error": err.strip()}


def test_the_servers_configuration_is_not_a_requests(server):
    with server.client() as c:
        for body, words in [
            ({"model": "preset:gpt-oss-120b", "oracle": "/usr/bin/llama-fit-params", "args": ["-ngl", "1"]},
             "server's configuration"),
            ({"model": MODEL, "gpu": "16GiB", "build": "/usr/local/bin/llama-server"}, "program path"),
            ({"model": MODEL, "gpu": "16GiB", "json": False}, "server's configuration"),
            ({"model": MODEL, "gpu": "16GiB", "rm -rf": True}, "not an option"),
            ({"model": "/etc/passwd", "gpu": "16GiB"}, "outside the folders"),
            ({"model": "../../etc/passwd", "gpu": "16GiB"}, "outside the folders"),
            ({"model": MODEL, "hardware": "/etc/hosts.json"}, "outside the folders"),
        ]:
            r = c.post("/api/plan" if "args" not in body else "/api/explain", json=body)
            assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
        r = c.post("/api/explain", json={"model": MODEL, "args": "-ngl 99; rm -rf /"})
        assert r.status_code == 400 and "never a shell string" in r.json()["error"]
        for body in ({"model": MODEL, "engine": "sim", **HW, "storage": "sqlite:////tmp/x.db"},
                     {"model": MODEL, "engine": "sim", **HW, "llama-bench": "/bin/sh"},
                     {"model": MODEL, "engine": "sim", **HW, "out": "/etc"}):
            r = c.post("/api/tunes", json=body)
            assert r.status_code == 400 and "server's configuration" in r.json()["error"], r.text
        r = c.post("/api/tunes", json={"model": MODEL, "engine": "llamacpp", **HW})
        assert r.status_code == 400 and "not enabled on this server" in r.json()["error"]
        r = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 100000})
        assert r.status_code == 400 and "at most 200" in r.json()["error"]
        r = c.post("/api/tunes", json={"model": MODEL, **HW, "study": "../../etc/x"})
        assert r.status_code == 400 and "study name" in r.json()["error"]
        # a model under the server's --models folder is allowed, by name or by its path
        r = c.post("/api/inspect", json={"model": "tiny.gguf"})
        assert r.status_code == 200 and r.json()["arch"] == "qwen3moe", r.text


def test_http_guards(server):
    with server.client() as c:
        r = c.post("/api/plan", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"].startswith("offload-tuner: error: the request body is not JSON")
        r = c.post("/api/plan", content=json.dumps({"model": MODEL}), headers={"content-type": "text/plain"})
        assert r.status_code == 415
        r = c.post("/api/plan", json={"model": MODEL, "gpu": "x" * 70000})
        assert r.status_code == 413
        r = c.post("/api/plan", content=b"[" * 60000, headers={"content-type": "application/json"})
        assert r.status_code == 400
        r = c.post("/api/plan", json=["plan", MODEL])
        assert r.status_code == 400 and "JSON object" in r.json()["error"]
        r = c.get("/api/plan")
        assert r.status_code == 405 and r.json()["error"].startswith("offload-tuner: error:")
        r = c.get("/api/studies/nope")
        assert r.status_code == 404 and "no study 'nope'" in r.json()["error"]
        r = c.get("/api/tunes/nope")
        assert r.status_code == 404
        r = c.get("/api/health", headers={"host": "evil.example:80"})      # DNS rebinding
        assert r.status_code == 421
        r = c.get("/openapi.json")
        assert r.status_code == 200
        spec = r.json()
        assert {"/api/plan", "/api/explain", "/api/inspect", "/api/studies", "/api/studies/{name}", "/api/tunes",
                "/api/tunes/{job_id}/stop", "/api/tunes/{job_id}/events"} <= set(spec["paths"])
        plan_schema = spec["paths"]["/api/plan"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert {"model", "gpu", "hardware", "ctx", "dialect", "objective"} <= set(plan_schema["properties"])
    assert "Traceback" not in server.log.read_text()


def test_studies(server):
    with server.client() as c:
        r = c.get("/api/studies")
        assert r.status_code == 200
        brief = next(s for s in r.json()["studies"] if s["study"] == STUDY)
        assert brief["engine"] == "sim" and brief["n_trials"] >= 12 and brief["best_tg_tps"] > 0
        d = c.get(f"/api/studies/{STUDY}").json()
    rep = json.loads(cli("report", STUDY, "--json", "--out", str(server.workdir / "reports" / STUDY),
                         cwd=server.workdir).stdout)
    for key in ("best", "pareto", "baselines", "per_budget", "counts", "settings", "budget_bytes"):
        assert d[key] == json.loads(json.dumps(rep[key])), key
    assert len(d["trials"]) == d["n_trials"] and d["vram_fronts"]["tg"] and d["vram_fronts"]["pp"]
    assert {b["name"] for b in d["baselines"]} >= {"-ngl 49 -cmoe"}   # as its command says
    assert any("tg_x" in r for r in d["pareto"])       # ratios against the --fit-like reference


def test_token_off_loopback(workdir):
    r = cli("serve", "--host", "0.0.0.0", "--port", "1", cwd=workdir, check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "give --token" in r.stderr
    token = "t0ken-for-the-test-1234"
    s = start_server(workdir, "--token", token)
    try:
        with s.client() as c:
            assert c.get("/api/studies").status_code == 401
            assert c.get("/api/studies", headers={"Authorization": "Bearer wrong-token-xxxxxxxx"}).status_code == 401
            assert c.get("/api/studies", headers={"Authorization": f"Bearer {token}"}).status_code == 200
            r = c.get(f"/?token={token}")            # a browser: once in the URL, then the cookie, and the URL again
            assert r.status_code == 303 and r.headers["location"] == "/"         # without the token
            assert "offload_tuner_token" in r.headers["set-cookie"]
            assert c.get("/api/studies").status_code == 200
    finally:
        s.stop()


@pytest.mark.slow
def test_tune_lifecycle(server):
    with server.client() as c:
        r = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 150, "pool": 40, "study": "api-stop",
                                       "objective": "tg"})
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["state"] == "running" and "--storage=sqlite:///" in " ".join(job["command"])
        busy = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 5, "study": "other"})
        assert busy.status_code == 429 and "at most 1" in busy.json()["error"]
        seen = events(c, f"/api/tunes/{job['id']}/events", lambda name, d: d.get("n_trials", 0) >= 3)
        assert seen[-1]["event"] == "progress" and seen[-1]["job"]["id"] == job["id"]
        stopped = c.post(f"/api/tunes/{job['id']}/stop").json()
        assert stopped["id"] == job["id"]
        end = wait_job(c, job["id"], timeout=60)
        assert end["state"] == "stopped", end
        d = c.get("/api/studies/api-stop").json()
        assert d["n_trials"] >= 3


@pytest.mark.slow
def test_a_killed_worker_costs_only_its_job(server):
    with server.client() as c:
        job = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 150, "pool": 40, "study": "api-kill",
                                         "objective": "tg"}).json()
        events(c, f"/api/tunes/{job['id']}/events", lambda name, d: d.get("n_trials", 0) >= 3)
        os.kill(job["pid"], signal.SIGKILL)
        end = wait_job(c, job["id"], timeout=30)
        assert end["state"] == "failed" and "signal 9" in end["error"], end
        assert c.get("/api/health").status_code == 200
        before = c.get("/api/studies/api-kill").json()["counts"]
        assert sum(before.values()) >= 3
        # the same tune resumes the study (the dead worker's SQLite lock went with it)
        again = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 3, "pool": 40, "study": "api-kill",
                                           "objective": "tg"})
        assert again.status_code == 202, again.text
        done = wait_job(c, again.json()["id"])
        assert done["state"] == "done", done
        result = c.get(f"/api/tunes/{done['id']}").json()["result"]
        assert result["study"] == "api-kill" and result["counts"]["complete"] > before.get("complete", 0)
