"""The web forms rank as the CLI does by default (issue 40, item 1): plan's and tune's objective is time first (the
workload's mean request time), with the workload offered (the presets; a .toml or .jsonl under the server's --models
folders) and, for tune, the TTFT limit."""
from __future__ import annotations

import html
import json

from serving import MODEL


def _form(page: str, form_id: str) -> str:
    start = page.index(f"<form id={form_id}") if f"<form id={form_id}" in page else page.index(f"id={form_id}")
    return page[start:page.index("</form>", start)]


def test_the_forms_offer_time_first_the_workload_and_ttft(server):
    with server.client() as c:
        tune = _form(c.get("/").text, "tune-form")
        plan = _form(c.get("/plan").text, "plan-form")
    assert "<select name=objective><option>time</option><option>tg</option>" in tune
    assert "<option selected>time</option>" in plan
    for form in (tune, plan):
        assert '<select name=workload><option value="" selected>default (chat)</option>' in form
        assert all(f'<option value="{w}">{w}</option>' in form for w in ("agent", "rag", "batch"))
        assert "name=workload_file" in form            # this server has --models folders
    assert "name=ttft" in tune


def test_the_plan_page_ranks_by_time_and_reads_a_workload_file_under_models(server):
    (server.workdir / "models" / "forms-mine.toml").write_text("[[request]]\nnew_tokens = 4000\ngen_tokens = 50\n")
    with server.client() as c:
        default = c.get("/plan", params={"model": MODEL, "gpu": "16GiB"}).text
        want = c.post("/api/plan", json={"model": MODEL, "gpu": "16GiB"}).json()
        mine = c.get("/plan", params={"model": MODEL, "gpu": "16GiB", "workload": "rag",
                                      "workload_file": "forms-mine.toml"}).text
        tg = c.get("/plan", params={"model": MODEL, "gpu": "16GiB", "objective": "tg"}).text
        outside = c.get("/plan", params={"model": MODEL, "gpu": "16GiB", "workload_file": "/etc/x.toml"}).text
    assert want["objective"] == "time, workload chat"
    assert "objective time, workload chat:" in default and f"mean request {want['predicted']['mean_request_s']:.2f} s" \
        in default and "<th>request s</th>" in default
    assert "objective time, workload forms-mine:" in mine        # the file stands for the preset chosen
    assert "objective tg:" in tg and "<th>request s</th>" not in tg
    assert "outside the folders this server serves" in html.unescape(outside)


def test_a_tune_body_from_the_form_carries_the_workload_file_and_ttft(tmp_path):
    from offload_tuner.service import bodies
    from offload_tuner.service.security import PathPolicy
    (tmp_path / "w.jsonl").write_text(json.dumps({"prompt_tokens": 900, "completion_tokens": 40}) + "\n")
    o = bodies.request("tune", {"model": MODEL, "gpu": "16GiB", "objective": "time", "workload": "w.jsonl",
                                "ttft": "3s"}, PathPolicy((tmp_path,)))
    argv = o.to_argv()
    assert f"--workload={(tmp_path / 'w.jsonl').resolve()}" in argv and "--ttft=3s" in argv
