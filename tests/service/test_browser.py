"""The web view in a real headless Chromium (Debian's, see browser.py) driven by Selenium: the front chart
renders, a click on a front point shows flags that parse back to that trial's plan, the trials table sorts, the
explain page shows the per-device table, a running study updates live. Screenshots: reports/service/*.png."""
from __future__ import annotations

import os
import shlex
from urllib.parse import urlencode

import pytest

from serving import HW, MODEL, REPO, SCREENSHOTS, STUDY, cli, wait, wait_job

# the README's screenshots: remade from the program as it is by `make screenshots` (README_SCREENSHOTS=1); a plain
# test run leaves the tracked images alone (another Chromium renders other pixels)
README_IMG = REPO / "docs" / "img" if os.environ.get("README_SCREENSHOTS") == "1" else None


def readme_shot(chrome, name: str) -> None:
    if README_IMG is not None:
        chrome.save_screenshot(str(README_IMG / name))


def test_study_page_front_click_gives_flags_that_parse_back(server, chrome):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    chrome.get(f"{server.url}/studies/{STUDY}")
    wait(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), what="the page's script")
    sets = chrome.execute_script("return Object.fromEntries(otCharts.tg_tps.data.datasets.map("
                                 "d => [d.label, d.data.length]))")
    assert sets["front"] >= 1 and sets["trials"] + sets["front"] >= 5 and sets["budget"] == 2, sets
    assert "-ngl 49 -cmoe" in sets, sets          # the engine baselines are drawn, named as their commands
    chrome.save_screenshot(str(SCREENSHOTS / "serve_study.png"))
    readme_shot(chrome, "serve_study.png")

    # click the front point with the most TG (the last one, at the most VRAM)
    canvas = chrome.find_element(By.ID, "chart-tg")
    # the whole canvas in view (the answer panel sits above it): the driver aims from its visible part's centre
    chrome.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    # the trials drawn where that point is (a repeated config sits on it): the click opens one of them
    x, y, trials = chrome.execute_script(
        "const c = otCharts.tg_tps; const i = c.data.datasets.findIndex(d => d.label === 'front');"
        "const pts = c.getDatasetMeta(i).data; const k = pts.length - 1; const X = pts[k].x, Y = pts[k].y;"
        "const at = []; c.data.datasets.forEach((d, j) => c.getDatasetMeta(j).data.forEach((p, n) => {"
        "  const row = d.data[n] && d.data[n].ref && d.data[n].ref.row;"
        "  if (row && Math.abs(p.x - X) < 3 && Math.abs(p.y - Y) < 3) at.push(row.trial); }));"
        "return [X, Y, at];")
    w, h = canvas.size["width"], canvas.size["height"]
    ActionChains(chrome).move_to_element_with_offset(canvas, int(x - w / 2), int(y - h / 2)).pause(0.3) \
        .click().perform()
    panel = chrome.find_element(By.ID, "config")
    wait(lambda: panel.is_displayed(), what="the config panel")
    title = chrome.find_element(By.ID, "config-title").text
    trial = int(title.split(":")[0].split()[1])
    if trial not in trials:        # Chart.js opens the nearest point: another one drawn within a few pixels
        far = chrome.execute_script(
            "const [t, X, Y] = arguments; const c = otCharts.tg_tps; let best = 1e9;"
            "c.data.datasets.forEach((d, j) => c.getDatasetMeta(j).data.forEach((p, n) => {"
            "  const row = d.data[n] && d.data[n].ref && d.data[n].ref.row;"
            "  if (row && row.trial === t) best = Math.min(best, Math.hypot(p.x - X, p.y - Y)); }));"
            "return best;", trial, x, y)
        assert far < 12, (title, trials, far)
    tools = {el.get_attribute("data-tool"): el.find_element(By.TAG_NAME, "code").text
             for el in panel.find_elements(By.CSS_SELECTOR, ".cmd")}
    assert set(tools) == {"llama-server", "llama-cli", "llama-bench"}, tools
    button = panel.find_element(By.CSS_SELECTOR, ".cmd[data-tool='llama-server'] button")
    button.click()
    wait(lambda: button.text == "copied", what="the copy button")
    chrome.save_screenshot(str(SCREENSHOTS / "serve_study_clicked.png"))

    # the llama-server line parses back to the trial's plan: same memory per device, byte for byte
    words = shlex.split(tools["llama-server"])
    while "=" in words[0]:                 # GGML_OP_OFFLOAD_MIN_BATCH=... before the program
        words.pop(0)
    with server.client() as c:
        d = c.get(f"/api/studies/{STUDY}").json()
        row = next(t for t in d["trials"] if t["trial"] == trial)
        r = c.post("/api/explain", json={"model": MODEL, **HW, "args": words})
    assert r.status_code == 200, r.text
    ex = r.json()
    assert ex["devices"]["CUDA0"]["total"] == row["pred_bytes_CUDA0"]
    assert not [w for w in ex["warnings"] if w.startswith("W100")]     # fits, as the study said

    # the trials table sorts: TG descending puts the best TG first
    chrome.find_element(By.CSS_SELECTOR, "#trials th[data-key='tg_tps']").click()
    first = chrome.find_element(By.CSS_SELECTOR, "#trials tbody tr").get_attribute("data-trial")
    best = max((t for t in d["trials"] if t["tg_tps"] is not None), key=lambda t: t["tg_tps"])
    assert d["trials"][int(first)]["tg_tps"] == best["tg_tps"]


def test_explain_page_shows_every_device(server, chrome):
    from selenium.webdriver.common.by import By
    q = urlencode({"model": MODEL, "gpu": "16GiB", "dialect": "mainline",
                   "cmd": "llama-server -m model.gguf -ngl 99 -ot 'blk\\.(2[4-9]|3[0-9]|4[0-7])\\.ffn_.*_exps=CPU' "
                          "-c 8192 -fa on"})
    chrome.get(f"{server.url}/explain?{q}")
    rows = chrome.find_elements(By.CSS_SELECTOR, "#devices tbody tr")
    devs = [r.find_elements(By.TAG_NAME, "td")[0].text for r in rows]
    assert devs == ["CUDA0", "CPU"], devs
    layers = chrome.find_element(By.ID, "layers").text
    assert "blk 24-47" in layers and "gate:CPU" in layers
    assert "predicted: PP" in chrome.find_element(By.ID, "predicted").text
    chrome.save_screenshot(str(SCREENSHOTS / "serve_explain.png"))
    readme_shot(chrome, "serve_explain.png")
    chrome.get(f"{server.url}/explain?" + urlencode({"model": MODEL, "cmd": "-ngl 99 -ot 'blk\\.{1,3}=CPU'"}))
    err = chrome.find_element(By.ID, "explain-error").text
    assert err.startswith("offload-tuner: error: -ot") and "comma" in err


@pytest.mark.slow
def test_study_page_is_live_while_a_tune_runs(server, chrome):
    from selenium.webdriver.common.by import By
    with server.client() as c:
        job = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 25, "pool": 40, "study": "web-live",
                                         "objective": "both"}).json()
        assert job["state"] == "running", job
        wait(lambda: c.get("/api/studies/web-live").status_code == 200, 60, "the study to exist")
        chrome.get(f"{server.url}/studies/web-live")
        start = int(chrome.find_element(By.ID, "ntrials").text)
        wait(lambda: int(chrome.find_element(By.ID, "ntrials").text) > start, 90, "a live update")
        wait_job(c, job["id"])
        d = c.get("/api/studies/web-live").json()
        n = d["n_trials"] - d["counts"].get("waiting", 0)      # queued trials that did not run are listed apart
    wait(lambda: int(chrome.find_element(By.ID, "ntrials").text) == n, 30, "the last update")
    assert chrome.execute_script("return otCharts.tg_tps.data.datasets[1].data.length") >= 1


def test_study_page_shows_the_served_stage_live(server, workdir, chrome):
    """A study whose served stage is under way (issue 41 item 1): its server runs as a table below the answer, with
    the runs left and their minutes, and a new run appears without a reload (its progress event says it)."""
    import optuna

    from tuner.records import StudyRecord
    cli("tune", MODEL, "--engine", "sim", "--hardware", HW["hardware"], "--gpu", HW["gpu"], "--trials", "4",
        "--pool", "20", "--study", "web-served", "--workload", "agent", "--no-report", "--quiet", cwd=workdir)
    study = optuna.load_study(study_name="web-served",
                              storage=f"sqlite:///{workdir / 'studies' / 'web-served.db'}")

    def run(key: str, rnd: int, request_s: float) -> dict:        # a row as tuner/served.py stores one
        return {"round": rnd, "key": key, "machine": "m", "ok": True, "error": "", "request_s": request_s,
                "ttft_s": 0.93, "ttft_max_s": 1.1, "pp_tps": 900.0, "tg_tps": 40.0, "peak_bytes": {"CUDA0": 7 << 30},
                "command": "llama-server -m MODEL.gguf", "seconds": 60.0, "ready_s": 5.0}
    stage = {"keys": ["fit:512", "trial:1"], "rounds": 2, "fills": {}, "kv_refs": [], "drop_behind": 1.3,
             "elsewhere": [], "screened": {}, "thrift": None}
    StudyRecord.save(study, serving={**stage, "rows": [run("fit:512", 0, 9.49), run("trial:1", 0, 8.95)],
                                     "left": 2, "eta_s": 120.0})
    chrome.get(f"{server.url}/studies/web-served")
    wait(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), what="the page's script")

    def table() -> list[list[str]]:        # read in one script: a live update replaces the rows under a reader
        return chrome.execute_script("return [...document.querySelectorAll('#serving-table tbody tr')]"
                                     ".map(tr => [...tr.cells].map(td => td.textContent))")
    assert table() == [["1", "--fit", "1", "9.49", "0.93", "7.00", "60"], ["2", "trial 1", "1", "8.95", "0.93",
                                                                          "7.00", "60"]]
    assert chrome.execute_script("return document.getElementById('serving-says').textContent") == \
        "2 server runs so far; 2 left, about 2 min."
    StudyRecord.save(study, serving={**stage, "rows": [run("fit:512", 0, 9.49), run("trial:1", 0, 8.95),
                                                       run("fit:512", 1, 9.52)], "left": 1, "eta_s": 60.0})
    wait(lambda: len(table()) == 3, 30, "the served run to appear live")
    assert table()[2][:4] == ["3", "--fit", "2", "9.52"]
    assert chrome.execute_script("return document.getElementById('serving-says').textContent") == \
        "3 server runs so far; 1 left, about 1 min."
    chrome.save_screenshot(str(SCREENSHOTS / "serve_study_serving.png"))
