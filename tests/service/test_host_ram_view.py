"""The host's row on the web view and over the API (issue 40, item 3): a `ram` field in plan and explain requests
(the same request field the CLI's --ram is), the host RAM table in parts on the plan and explain pages, W104 when the
weights in RAM do not fit."""
from __future__ import annotations

from serving import MODEL


def test_plan_api_and_page_bill_the_host(server):
    with server.client() as c:
        short = c.post("/api/plan", json={"model": "preset:DeepSeek-V3", "gpu": "24GiB", "ram": "128GiB",
                                          "objective": "tg"}).json()
        assert short["host_ram"]["ram"] == 128 << 30 and short["host_ram"]["shortfall"] > 0
        assert [w for w in short["warnings"] if w.startswith("W104")]
        assert short["commands"]["llama-server"].endswith("--cache-ram 0")
        page = c.get("/plan", params={"model": MODEL, "gpu": "16GiB", "ram": "64GiB", "objective": "tg"}).text
        assert "id=plan-host" in page and "prompt cache (--cache-ram 8192)" in page and "64.00 GiB" in page
        assert 'name=ram value="64GiB"' in page
        page = c.get("/plan", params={"model": "preset:DeepSeek-V3", "gpu": "24GiB", "ram": "128GiB",
                                      "objective": "tg"}).text
        assert "<tr class=over><td>short</td>" in page and "W104" in page


def test_explain_page_bills_the_host(server):
    with server.client() as c:
        page = c.get("/explain", params={"model": MODEL, "gpu": "16GiB", "ram": "32GiB",
                                         "cmd": "llama-server -ngl 99 -cmoe -c 8192 -np 1 -fa on"}).text
        assert "id=host" in page and "prompt cache (--cache-ram 8192)" in page and "32.00 GiB" in page
        got = c.post("/api/explain", json={"model": MODEL, "gpu": "16GiB", "ram": "32GiB",
                                           "args": ["-ngl", "99", "-cmoe", "--cache-ram", "1024"]}).json()
        assert got["host_ram"]["cache_ram_mib"] == 1024 and got["host_ram"]["ram"] == 32 << 30
