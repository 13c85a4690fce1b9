"""The service under hostile input (issue 43), on a real server: files that are not regular files or are far too
large, a request past its time limit, a study name too long for a file name, a storage password, a token in a
query string, the state folder at exit, a host that does not resolve. Each is one line with a 4xx (or 503 for the
time limit), and the server goes on answering the next client."""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from pathlib import Path

import httpx
import pytest

from serving import MODEL, cli, start_server

TOKEN = "a-token-of-sixteen-chars"


def _one_line(r: httpx.Response) -> str:
    text = r.json()["error"]
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A server with --models DIR, where DIR holds FIFOs, a 2 MiB 'profile' and, where mknod is allowed (root), a
    character device like /dev/zero (a link to /dev/zero itself resolves outside DIR and is refused as such)."""
    d = tmp_path_factory.mktemp("hostile")
    models = d / "models"
    models.mkdir()
    os.mkfifo(models / "pipe.gguf")
    os.mkfifo(models / "pipe.json")
    (models / "huge.json").write_bytes(b"{" + b" " * (2 << 20) + b"}")
    with contextlib.suppress(PermissionError):
        os.mknod(models / "zero.json", 0o644 | stat.S_IFCHR, os.makedev(1, 5))
    s = start_server(d, "--models", str(models))
    yield s
    s.stop()


@pytest.mark.parametrize("body, words", [
    ({"model": "pipe.gguf", "gpu": "16GiB"}, "pipe.gguf: a FIFO (named pipe), not a file"),
    ({"model": MODEL, "hardware": "pipe.json"}, "pipe.json: a FIFO (named pipe), not a file"),
    ({"model": MODEL, "hardware": "zero.json"}, "zero.json: a character device, not a file"),
    ({"model": MODEL, "hardware": "huge.json"}, "huge.json: over 1 MiB"),
])
def test_a_file_that_is_not_a_small_regular_file_is_one_line_and_blocks_no_one(hostile, body, words):
    if body.get("hardware") == "zero.json" and not (hostile.workdir / "models" / "zero.json").exists():
        pytest.skip("mknod is not allowed here (not root): no device file to name")
    with hostile.client() as c:
        t0 = time.monotonic()
        r = c.post("/api/plan", json=body)
        assert r.status_code == 400 and words in _one_line(r), r.text
        assert time.monotonic() - t0 < 30
        ok = c.post("/api/explain", json={"model": MODEL, "gpu": "16GiB", "args": ["-ngl", "99"]})
        assert ok.status_code == 200, ok.text      # the next client is answered


def test_the_explain_page_reads_no_fifo_in_the_server(hostile):
    with hostile.client() as c:
        r = c.get("/explain", params={"model": "pipe.gguf", "gpu": "16GiB", "cmd": "-ngl 99"})
        assert r.status_code == 200 and "a FIFO (named pipe), not a file" in r.text
        r = c.get("/plan", params={"model": MODEL, "hardware": "huge.json"})
        assert r.status_code == 200 and "huge.json: over 1 MiB" in r.text
        assert c.get("/api/health").status_code == 200


def test_a_request_past_the_time_limit_is_503_and_its_worker_replaced(tmp_path):
    s = start_server(tmp_path, "--request-limit", "0.05")
    try:
        with s.client() as c:
            r = c.post("/api/plan", json={"model": "preset:DeepSeek-V3", "gpu": "24GiB"})
            assert r.status_code == 503 and "took over 0.05 s, this server's limit" in _one_line(r)
            again = c.post("/api/plan", json={"model": "preset:DeepSeek-V3", "gpu": "24GiB"})
            assert again.status_code == 503          # a fresh worker, the same limit: no hang, no 500
            assert c.get("/api/health").status_code == 200
    finally:
        s.stop()
    assert "took over" in s.log.read_text()


def test_a_study_name_too_long_for_a_file_is_404(server):
    with server.client() as c:
        for path in ("/api/studies/", "/api/studies/{}/events"):
            r = c.get(path.format("x" * 10_000) if "{}" in path else path + "x" * 10_000)
            assert r.status_code == 404, r.text
            assert "no study named" in _one_line(r)
        r = c.get("/api/studies/" + "y" * 200)       # past the file rule, short enough to look for: a 404 too
        assert r.status_code == 404 and "no study 'yyy" in _one_line(r)


def test_a_storage_password_is_never_shown(tmp_path, postgres_server):
    url = postgres_server.url.replace("tuner@", "tuner:Sw0rdf1sh@")     # trust auth: any password logs in
    s = start_server(tmp_path, "--storage", url)
    try:
        with s.client() as c:
            health = c.get("/api/health")
            index = c.get("/")
            assert health.status_code == 200 and "tuner:***@" in health.json()["storage"]
            assert "Sw0rdf1sh" not in health.text and "Sw0rdf1sh" not in index.text
    finally:
        s.stop()
    assert "Sw0rdf1sh" not in s.log.read_text()


def test_a_storage_that_cannot_be_reached_stops_serve_before_it_starts(tmp_path):
    r = cli("serve", "--port", "0", "--storage", "postgresql://alice:Sw0rdf1sh@127.0.0.1:1/db", cwd=tmp_path,
            check=False)
    assert r.returncode == 2 and "Sw0rdf1sh" not in r.stderr + r.stdout
    assert r.stderr.count("\n") == 1 and "cannot open storage" in r.stderr and "Traceback" not in r.stderr


def test_the_token_in_a_query_string_stays_out_of_the_access_log(tmp_path):
    s = start_server(tmp_path, "--token", TOKEN)
    try:
        with s.client(follow_redirects=False) as c:
            c.get("/", params={"token": TOKEN})
            c.get("/explain", params={"token": TOKEN, "model": MODEL})
    finally:
        s.stop()
    log = s.log.read_text()
    assert TOKEN not in log and '"GET / HTTP/1.1"' in log and '"GET /explain HTTP/1.1"' in log


def test_the_state_folder_goes_at_exit(tmp_path):
    folder = tmp_path / "tmp"
    folder.mkdir()
    os.environ["TMPDIR"] = str(folder)          # the server's tempfile.mkdtemp lands here (serving.env copies it)
    try:
        s = start_server(tmp_path)
    finally:
        del os.environ["TMPDIR"]
    assert [p.name for p in folder.iterdir() if p.name.startswith("offload-tuner-serve-")]
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(timeout=30) in (0, 130)
    assert not [p for p in folder.iterdir() if p.name.startswith("offload-tuner-serve-")]


@pytest.mark.parametrize("port", ["0", "8799"])
def test_a_host_that_does_not_resolve_is_refused_before_start(tmp_path, port):
    r = cli("serve", "--host", "no-such-host.invalid", "--port", port, "--token", TOKEN, cwd=tmp_path, check=False)
    assert r.returncode == 2 and r.stderr.startswith("offload-tuner: error: --host no-such-host.invalid")
    assert r.stderr.count("\n") == 1


def test_no_worker_is_left_after_the_server(tmp_path):
    s = start_server(tmp_path)
    with s.client() as c:
        assert c.post("/api/plan", json={"model": MODEL, "gpu": "16GiB"}).status_code == 200
    kids = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == s.proc.pid]
    assert kids                                  # the workers this server started
    s.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in kids if _alive(p)]:
        time.sleep(0.2)
    assert not [p for p in kids if _alive(p)]


def _alive(proc: Path) -> bool:
    """Running (a zombie waits for a reaper, and is not running)."""
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
