"""Helpers and fixtures of the service tests (conftest.py makes the fixtures visible): the real thing,
`offload-tuner serve` as a subprocess on a free loopback port, over a folder with a real sim-engine study written
by `offload-tuner tune` (SQLite, as tune writes it by default)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
STUDY = "web"
MODEL = "preset:Qwen3-30B-A3B"
HW = {"hardware": "rtx4090-ddr5", "gpu": "16GiB"}
SCREENSHOTS = REPO / "reports" / "service"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [e.get("PYTHONPATH")])])
    return e


def cli(*argv: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "offload_tuner.cli", *argv], cwd=cwd, env=env(), capture_output=True,
                       text=True, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"offload-tuner {' '.join(argv)} -> {r.returncode}: {r.stderr[-2000:]}")
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str
    workdir: Path
    proc: subprocess.Popen
    log: Path

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(workdir: Path, *extra: str, host: str = "127.0.0.1") -> Server:
    port = free_port()
    log = workdir / f"serve-{port}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "offload_tuner.cli", "serve", "--host", host, "--port",
                                 str(port), *extra], cwd=workdir, env=env(), stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            headers = {"Authorization": f"Bearer {extra[extra.index('--token') + 1]}"} if "--token" in extra else {}
            if httpx.get(url + "/api/health", timeout=2, headers=headers).status_code == 200:
                return Server(url, workdir, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"serve did not answer in 60 s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="session")
def workdir(tmp_path_factory) -> Path:
    """A folder with studies/web.db (a 12-run sim study, objective both) and models/ (a tiny GGUF)."""
    d = tmp_path_factory.mktemp("serve")
    cli("tune", MODEL, "--engine", "sim", "--hardware", HW["hardware"], "--gpu", HW["gpu"], "--trials", "12",
        "--pool", "40", "--study", STUDY, "--objective", "both", "--no-report", "--quiet", cwd=d)
    (d / "models").mkdir()
    from runtime.synth import tiny_spec, uniform_recipe, write_gguf
    write_gguf(d / "models" / "tiny.gguf", tiny_spec("qwen3moe"), uniform_recipe("Q8_0", None))
    return d


@pytest.fixture(scope="module")
def chrome():
    """A headless Chromium driven by Selenium (browser.py), one per test module; skipped where there is none."""
    import browser
    try:
        b = browser.find()
    except browser.Unavailable as e:
        pytest.skip(f"no headless Chromium: {e}")
    d = browser.driver(b)
    d.set_page_load_timeout(60)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    yield d
    d.quit()


@pytest.fixture(scope="session")
def server(workdir: Path):
    s = start_server(workdir, "--models", str(workdir / "models"))
    yield s
    s.stop()


def wait(pred, timeout: float = 30.0, what: str = "condition"):
    """pred()'s first true value, asked every 0.1 s (a browser's page state), or an AssertionError after timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_job(client: httpx.Client, job_id: str, timeout: float = 240) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        j = client.get(f"/api/tunes/{job_id}").json()
        if j["state"] != "running":
            return j
        time.sleep(0.5)
    raise AssertionError(f"tune {job_id} still running after {timeout} s")


def events(client: httpx.Client, path: str, until, timeout: float = 120) -> list[dict]:
    """Read server-sent events from PATH until until(event_name, data) is true."""
    seen = []
    with client.stream("GET", path, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                seen.append({"event": name, **data})
                if until(name, data):
                    break
    return seen
