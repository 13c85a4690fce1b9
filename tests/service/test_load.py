"""Load on loopback: 50 concurrent plan/explain requests while a sim study runs (no error; p95 latency reported in
reports/service/load.json and printed), then a storm of malformed requests (all 4xx, never a 500) after which
the server and its tune are still fine."""
from __future__ import annotations

import pytest

import asyncio
import json
import time

import httpx

from serving import HW, MODEL, SCREENSHOTS, events, wait_job

N = 50
EXPLAIN_ARGS = ["-ngl", "99", "-ot", "blk\\.(3[0-9]|4[0-7])\\.ffn_.*_exps=CPU", "-c", "8192", "-fa", "on"]


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def _burst(url: str) -> list[tuple[str, int, float]]:
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=N)) as c:
        async def one(i: int):
            t0 = time.perf_counter()
            if i % 2:
                r = await c.post("/api/explain", json={"model": MODEL, "gpu": "16GiB", "args": EXPLAIN_ARGS})
            else:
                r = await c.post("/api/plan", json={"model": MODEL, "gpu": f"{8 + i % 16}GiB", "objective": "tg"})
            return ("explain" if i % 2 else "plan", r.status_code, time.perf_counter() - t0)
        return await asyncio.gather(*(one(i) for i in range(N)))


MALFORMED = [
    (b"{", "application/json"), (b"", "application/json"), (b"null", "application/json"),
    (b'{"model": 5}', "application/json"), (b'{"model": ["a"]}', "application/json"),
    (b'{"model": "preset:Qwen3-30B-A3B", "gpu": {"a": 1}}', "application/json"),
    (b'{"model": "preset:Qwen3-30B-A3B", "ctx": 1e309}', "application/json"),
    (b'{"model": "preset:Qwen3-30B-A3B", "gpu": "-1GiB"}', "application/json"),
    (b'{"model": "preset:Qwen3-30B-A3B", "gpu": "16GiB", "ubatch": 0}', "application/json"),
    (b'{"model": "\\u0000"}', "application/json"), (b"\xff\xfe\x00garbage", "application/json"),
    (b'{"model": "preset:Qwen3-30B-A3B"}', "text/plain"), (b"[" * 50000, "application/json"),
    (b'{"model": "preset:Qwen3-30B-A3B", "args": [1, 2]}', "application/json"),
    (b'{"model": "preset:Qwen3-30B-A3B", "gpu": "16GiB", "objective": "__import__(\'os\')"}', "application/json"),
]


async def _storm(url: str) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def one(i: int):
            body, ctype = MALFORMED[i % len(MALFORMED)]
            path = ("/api/plan", "/api/explain", "/api/tunes", "/api/inspect")[i % 4]
            r = await c.post(path, content=body, headers={"content-type": ctype})
            return r.status_code, r.text
        big = c.post("/api/plan", content=b"x" * (1 << 20), headers={"content-type": "application/json"})
        out = await asyncio.gather(big, *(one(i) for i in range(200)))
        return [r.status_code if isinstance(r, httpx.Response) else r[0] for r in out], \
            [r.text if isinstance(r, httpx.Response) else r[1] for r in out]


@pytest.mark.slow
def test_load_with_a_running_study_and_a_malformed_storm(server):
    with server.client() as c:
        job = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 60, "pool": 60, "study": "load",
                                         "objective": "both"}).json()
        assert job["state"] == "running", job
        events(c, f"/api/tunes/{job['id']}/events", lambda name, d: d.get("n_trials", 0) >= 1)
        t0 = time.perf_counter()
        results = asyncio.run(_burst(server.url))
        wall = time.perf_counter() - t0
        running_during = c.get(f"/api/tunes/{job['id']}").json()["state"]
        statuses, texts = asyncio.run(_storm(server.url))
        assert c.get("/api/health").status_code == 200
        end = wait_job(c, job["id"])
    errors = [r for r in results if r[1] != 200]
    lat = [r[2] for r in results]
    figures = {"requests": N, "errors": len(errors), "wall_s": round(wall, 2),
               "p50_s": round(_pct(lat, 50), 3), "p95_s": round(_pct(lat, 95), 3), "max_s": round(max(lat), 3),
               "plan_p95_s": round(_pct([r[2] for r in results if r[0] == "plan"], 95), 3),
               "explain_p95_s": round(_pct([r[2] for r in results if r[0] == "explain"], 95), 3),
               "study_state_after_burst": running_during, "study_end": end["state"],
               "malformed": len(statuses), "malformed_statuses": sorted(set(statuses))}
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / "load.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nload: {json.dumps(figures)}")
    assert not errors, errors[:3]
    assert all(400 <= s < 500 for s in statuses), [(s, t) for s, t in zip(statuses, texts) if not 400 <= s < 500][:3]
    assert not any("Traceback" in t for t in texts)
    assert end["state"] == "done", end
    assert "Traceback" not in server.log.read_text()
