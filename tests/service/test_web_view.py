"""The web view's answers and manners (issue 29, items 4 and 7's web part), in the real headless Chromium the other
browser tests use (browser.py): the answer panel's numbers are report --json's, the charts keep their size across
live updates and a resize, a row click brings its panel into view, /docs renders with nothing from another
origin, queued trials that did not run are listed apart, the running badge follows a CLI tune writing the same
storage, the plan and tune forms work, the stop button stops, the legend shows the markers, command lines wrap
between flags only, the token leaves the address bar. Screenshots: reports/service/web_*.png."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from serving import HW, MODEL, SCREENSHOTS, STUDY, cli, env, start_server, wait


@pytest.fixture(autouse=True)
def window(chrome):
    chrome.set_window_size(1400, 1000)
    yield


def open_study(chrome, server, name=STUDY):
    chrome.get(f"{server.url}/studies/{name}")
    wait(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), what="the page's script")


def report_json(server, name=STUDY) -> dict:
    return json.loads(cli("report", name, "--json", "--out", str(server.workdir / "reports" / name),
                          cwd=server.workdir).stdout)


SIZES = ("return [...document.querySelectorAll('canvas')].map(c => {const r = c.getBoundingClientRect(); "
         "return [Math.round(r.width), Math.round(r.height)]})")


# ---- the answer panel -----------------------------------------------------------------------------------------

def test_answer_panel_is_report_json(server, chrome):
    from selenium.webdriver.common.by import By
    rep = report_json(server)
    open_study(chrome, server)
    table = {tr.get_attribute("data-role"): {td.get_attribute("data-key"): td.get_attribute("data-value")
                                             for td in tr.find_elements(By.TAG_NAME, "td")}
             for tr in chrome.find_elements(By.CSS_SELECTOR, "#answer-table tbody tr")}
    assert set(table) == {"tg", "pp", "reference"}, table          # objective both: best TG, best PP, --fit's
    for role in ("tg", "pp"):
        want = rep["best"][role]
        got = table[role]
        assert int(got["trial"]) == want["trial"]
        for key in ("tg_tps", "pp_tps", "vram_bytes", "budget_share", "tg_x", "pp_x", "vram_x"):
            assert float(got[key]) == pytest.approx(want[key], rel=1e-12), (role, key)
    ref = next(b for b in rep["baselines"] if b["name"] == rep["reference"])
    m = ref["measured"]
    assert float(table["reference"]["tg_tps"]) == pytest.approx(m["tg_tps"], rel=1e-12)
    assert float(table["reference"]["pp_tps"]) == pytest.approx(m["pp_tps"], rel=1e-12)
    vram = sum((m.get("peak_at_ctx") or m.get("peak_bytes")).values())
    assert float(table["reference"]["vram_bytes"]) == vram
    assert float(table["reference"]["budget_share"]) == pytest.approx(vram / rep["budget_bytes"], rel=1e-12)
    assert rep["reference"] in chrome.find_element(By.CSS_SELECTOR, "#answer-table tr[data-role=reference]").text
    says = chrome.find_element(By.ID, "answer-says").text
    assert "objective both" in says.lower() and "best TG and best PP" in says
    # the flags shown are best TG's, each with a copy button, the line as report --json has it
    lines = {el.get_attribute("data-tool"): el.find_element(By.TAG_NAME, "code").get_attribute("textContent")
             for el in chrome.find_elements(By.CSS_SELECTOR, "#answer-flags .cmd")}
    assert lines == rep["best"]["tg"]["commands"]
    button = chrome.find_element(By.CSS_SELECTOR, "#answer-flags .cmd[data-tool='llama-server'] button")
    button.click()
    wait(lambda: button.text == "copied", what="the copy button")
    # a click on best PP's row shows its flags
    chrome.find_element(By.CSS_SELECTOR, "#answer-table tr[data-role=pp]").click()
    lines = {el.get_attribute("data-tool"): el.find_element(By.TAG_NAME, "code").get_attribute("textContent")
             for el in chrome.find_elements(By.CSS_SELECTOR, "#answer-flags .cmd")}
    assert lines == rep["best"]["pp"]["commands"]
    chrome.save_screenshot(str(SCREENSHOTS / "web_answer.png"))


def test_answer_names_the_pick_of_a_tg_study(server, chrome):
    from selenium.webdriver.common.by import By
    cli("tune", MODEL, "--engine", "sim", "--hardware", HW["hardware"], "--gpu", HW["gpu"], "--trials", "6",
        "--pool", "30", "--study", "web-tg", "--objective", "tg", "--no-report", "--quiet", cwd=server.workdir)
    rep = report_json(server, "web-tg")
    open_study(chrome, server, "web-tg")
    pick = chrome.find_element(By.CSS_SELECTOR, "#answer-table tr.pick")
    assert pick.get_attribute("data-role") == "tg"
    trial = pick.find_element(By.CSS_SELECTOR, "td[data-key=trial]").get_attribute("data-value")
    assert int(trial) == rep["best"]["tg"]["trial"]
    says = chrome.find_element(By.ID, "answer-says").text
    assert says.startswith(f"Pick for objective tg: trial {rep['best']['tg']['trial']}, "
                           f"TG {rep['best']['tg']['tg_tps']:.2f} t/s"), says
    assert f"{rep['best']['tg']['tg_x']:.2f}x TG" in says


def test_a_time_study_answers_in_seconds_per_mean_request(server, chrome):
    # issue 40, item 6: the pick's seconds (lower is better), its stored tokens per second beside them
    from selenium.webdriver.common.by import By
    cli("tune", MODEL, "--engine", "sim", "--hardware", HW["hardware"], "--gpu", HW["gpu"], "--trials", "4",
        "--pool", "20", "--study", "web-time", "--no-report", "--quiet", cwd=server.workdir)
    best = report_json(server, "web-time")["best"]["objective"]
    open_study(chrome, server, "web-time")
    assert "objective time (chat: seconds per mean request, lower is better)" in chrome.find_element(
        By.TAG_NAME, "main").text
    says = chrome.find_element(By.ID, "answer-says").text
    assert says.startswith(f"Pick for objective time: trial {best['trial']}, {best['mean_request_s']:.2f} s per mean "
                           f"request ({best['value']:.1f} t/s of the workload), TG "), says
    pick = chrome.find_element(By.CSS_SELECTOR, "#answer-table tr.pick td[data-key=name]").text
    assert pick == f"best time = {best['mean_request_s']:.2f} s (pick)"


# ---- charts, the row click, the legend, command lines -----------------------------------------------------------

def test_charts_keep_their_size_across_updates_and_a_resize(server, chrome):
    open_study(chrome, server)
    before = chrome.execute_script(SIZES)
    assert len(before) == 2 and all(w > 300 and 200 < h < 600 for w, h in before), before
    for i in range(5):                  # what a live update does: fetch the study, redraw everything
        chrome.execute_script("otRefresh()")
        wait(lambda i=i: chrome.execute_script("return document.body.dataset.updates") == str(i + 1),
             what="a live update")
    assert chrome.execute_script(SIZES) == before
    chrome.set_window_size(800, 900)
    time.sleep(0.5)
    narrow = chrome.execute_script(SIZES)
    overflow = chrome.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    assert overflow[0] <= overflow[1], overflow          # the 800 px window does not scroll sideways
    assert all(w <= overflow[1] for w, _ in narrow), narrow
    chrome.execute_script("otRefresh()")
    wait(lambda: chrome.execute_script("return document.body.dataset.updates") == "6", what="a live update")
    chrome.set_window_size(1400, 1000)
    time.sleep(0.5)
    assert chrome.execute_script(SIZES) == before        # back where it was: no growth, side by side again


def test_a_row_click_brings_its_panel_into_view(server, chrome):
    from selenium.webdriver.common.by import By
    open_study(chrome, server)
    chrome.set_window_size(1400, 700)
    rows = chrome.find_elements(By.CSS_SELECTOR, "#trials tbody tr")
    last = rows[-1]
    chrome.execute_script("arguments[0].scrollIntoView({block: 'end'})", last)
    assert chrome.execute_script("return document.getElementById('config').hidden")
    last.click()
    rect = wait(lambda: chrome.execute_script(
        "const r = document.getElementById('config').getBoundingClientRect();"
        "return r.height > 0 ? [r.top, r.bottom, window.innerHeight] : null"), what="the panel")
    top, bottom, height = rect
    assert top >= 0 and bottom <= height, rect
    title = chrome.find_element(By.ID, "config-title").text
    assert title.startswith(f"trial {last.get_attribute('data-trial')}:")


def test_legend_shows_the_markers(server, chrome):
    open_study(chrome, server)
    items = chrome.execute_script(
        "const c = otCharts.tg_tps; return [c.options.plugins.legend.labels.usePointStyle, "
        "c.legend.legendItems.map(i => [i.text, i.pointStyle]), c.data.datasets.map(d => [d.label, d.pointStyle])]")
    use_point_style, legend, sets = items
    assert use_point_style is True
    assert dict(legend) == dict(sets)                   # each entry drawn with its dataset's marker
    assert dict(legend)["budget"] == "line" and dict(legend)["front"] == "circle"
    assert len({s for _, s in sets}) >= 4, sets          # baselines keep their own markers


def test_command_lines_wrap_between_flags_only(server, chrome):
    from selenium.webdriver.common.by import By
    open_study(chrome, server)
    chrome.set_window_size(800, 900)
    time.sleep(0.3)
    d = chrome.execute_script("return JSON.parse(document.getElementById('study-data').textContent)")
    # the longest line the study has (an -ot pattern of many layers) in the trial panel
    row = max(d["trials"], key=lambda t: len(t.get("llama-server") or ""))
    chrome.execute_script(f"document.querySelector('#trials tbody tr[data-trial=\"{row['trial']}\"]').click()")
    code = chrome.find_element(By.CSS_SELECTOR, "#config .cmd[data-tool='llama-server'] code")
    assert code.get_attribute("textContent") == row["llama-server"]     # what is shown is the line, as copied
    lines = chrome.execute_script(
        "const code = arguments[0];"
        "const lines = (el) => new Set([...el.getClientRects()].map(r => Math.round(r.top))).size;"
        "const flags = [...code.querySelectorAll('.flag')].map(f => [f.textContent, lines(f)]);"
        "const args = [...code.querySelectorAll('.arg:not(.long)')].map(a => [a.textContent, lines(a)]);"
        "const parts = [...code.querySelectorAll('.part')].map(p => [p.textContent, lines(p)]);"
        "return [code.getBoundingClientRect().height, flags, args, parts]", code)
    height, flags, args, parts = lines
    assert height > 30, "the 800 px window should wrap this line"
    assert flags and all(n == 1 for _, n in flags), flags          # no flag is split over two lines
    assert all(n == 1 for _, n in args), args                      # nor a flag from its (short) value
    assert len(parts) >= 2 and all(n == 1 for _, n in parts), parts   # -ot's list breaks after a comma only
    chrome.save_screenshot(str(SCREENSHOTS / "web_commands_narrow.png"))


# ---- /docs, queued trials, the running badge, the forms, the stop --------------------------------------------

def test_docs_render_from_the_package(server, chrome):
    from selenium.webdriver.common.by import By
    chrome.get(f"{server.url}/docs")
    items = chrome.find_elements(By.CSS_SELECTOR, "#api-index li")
    assert len(items) >= 10
    plan = chrome.find_element(By.ID, "post-api-plan")
    assert "model" in plan.text and "required" in plan.text and "gpu" in plan.text
    tune = chrome.find_element(By.ID, "post-api-tunes")
    assert "confirm_fresh" in tune.text
    # everything the page loaded came from the server itself: nothing from a CDN, so it renders offline
    urls = chrome.execute_script("return [location.href, ...performance.getEntriesByType('resource').map(e => e.name)]")
    assert all(u.startswith(server.url + "/") for u in urls), urls
    assert not chrome.find_elements(By.CSS_SELECTOR, "script[src^='http'], link[href^='http']")


def test_queued_trials_are_shown_apart(server, chrome):
    from selenium.webdriver.common.by import By
    import optuna
    src = f"sqlite:///{server.workdir / 'studies' / (STUDY + '.db')}"
    dst = f"sqlite:///{server.workdir / 'studies' / 'web-queued.db'}"
    optuna.copy_study(from_study_name=STUDY, from_storage=src, to_storage=dst, to_study_name="web-queued")
    study = optuna.load_study(study_name="web-queued", storage=dst)
    # the study may have queued trials of its own already (seeds its --trials left unrun): those count too
    waiting = optuna.trial.TrialState.WAITING
    ran = sum(t.state != waiting for t in study.trials)
    complete = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    queued = 3 + sum(t.state == waiting for t in study.trials)
    for _ in range(3):
        study.enqueue_trial(study.trials[0].params, skip_if_exists=False)
    open_study(chrome, server, "web-queued")
    assert chrome.find_element(By.ID, "ntrials").text == str(ran)
    assert "waiting" not in chrome.find_element(By.ID, "counts").text
    box = chrome.find_element(By.ID, "unrun-box")
    assert box.is_displayed() and chrome.find_element(By.ID, "unrun-n").text == str(queued)
    assert "stopped before" in chrome.find_element(By.ID, "unrun-why").text
    assert len(chrome.find_elements(By.CSS_SELECTOR, "#unrun tbody tr")) == queued
    assert not [r for r in chrome.find_elements(By.CSS_SELECTOR, "#trials tbody tr")
                if r.find_elements(By.TAG_NAME, "td")[1].text == "waiting"]
    chrome.get(server.url + "/")
    row = chrome.find_element(By.CSS_SELECTOR, "#studies tr[data-study='web-queued']")
    assert f"{queued} queued, not run" in row.text and f"{complete} complete" in row.text


@pytest.mark.slow
def test_running_badge_for_a_cli_tune_on_the_same_storage(server, chrome):
    from selenium.webdriver.common.by import By
    proc = subprocess.Popen([sys.executable, "-m", "offload_tuner.cli", "tune", MODEL, "--engine", "sim", "--hardware",
                             HW["hardware"], "--gpu", HW["gpu"], "--trials", "200", "--pool", "40", "--study",
                             "web-cli", "--objective", "both", "--no-report", "--quiet"],
                            cwd=server.workdir, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with server.client() as c:
            wait(lambda: c.get("/api/studies/web-cli").status_code == 200, 90, "the CLI's study")
            assert c.get("/api/studies/web-cli").json()["writer"]
        open_study(chrome, server, "web-cli")
        live = chrome.find_element(By.ID, "live")
        wait(live.is_displayed, 10, "the running badge")
        assert not chrome.find_element(By.ID, "stop").is_displayed()     # not this server's worker
        chrome.get(server.url + "/")
        assert "running" in chrome.find_element(By.CSS_SELECTOR, "#studies tr[data-study='web-cli']").text
        open_study(chrome, server, "web-cli")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        wait(lambda: not chrome.find_element(By.ID, "live").is_displayed(), 15, "the badge to go")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_plan_form(server, chrome):
    from selenium.webdriver.common.by import By
    chrome.get(f"{server.url}/plan")
    form = chrome.find_element(By.ID, "plan-form")
    gpu = form.find_element(By.NAME, "gpu")
    gpu.send_keys("16GiB")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait(lambda: chrome.find_elements(By.ID, "plan-predicted"), what="the plan")
    with server.client() as c:
        want = c.post("/api/plan", json={"model": MODEL, "gpu": "16GiB"}).json()
    text = chrome.find_element(By.ID, "plan-predicted").text
    assert f"TG {want['predicted']['tg_tps']:.2f} t/s" in text
    lines = {el.get_attribute("data-tool"): el.find_element(By.TAG_NAME, "code").get_attribute("textContent")
             for el in chrome.find_elements(By.CSS_SELECTOR, "#plan-commands .cmd")}
    assert lines == want["commands"]
    devs = [r.find_elements(By.TAG_NAME, "td")[0].text for r in
            chrome.find_elements(By.CSS_SELECTOR, "#plan-devices tbody tr")]
    assert devs == ["CUDA0", "CPU"]
    chrome.save_screenshot(str(SCREENSHOTS / "web_plan.png"))
    chrome.get(f"{server.url}/plan?model=preset:nope&gpu=16GiB")
    err = chrome.find_element(By.ID, "plan-error").text
    assert err.startswith("offload-tuner: error:") and "\n" not in err


@pytest.mark.slow
def test_tune_form_and_stop_button(server, chrome):
    from selenium.webdriver.common.by import By
    chrome.get(f"{server.url}/")
    form = chrome.find_element(By.ID, "tune-form")
    form.find_element(By.NAME, "gpu").send_keys("16GiB")
    form.find_element(By.NAME, "hardware").send_keys(HW["hardware"])
    trials = form.find_element(By.NAME, "trials")
    trials.clear()
    trials.send_keys("200")
    form.find_element(By.NAME, "study").send_keys("web-form")
    form.find_element(By.NAME, "fresh").click()          # fresh without its confirmation: refused, one line
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    err = wait(lambda: chrome.find_element(By.ID, "tune-error").text, what="the refusal")
    assert "confirm_fresh" in err and err.startswith("offload-tuner: error:")
    form.find_element(By.NAME, "fresh").click()
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait(lambda: chrome.current_url.endswith("/studies/web-form"), 30, "the study page")
    wait(lambda: chrome.execute_script("return document.body.dataset.ready === '1'"), 90, "the study")
    stop = chrome.find_element(By.ID, "stop")
    wait(stop.is_displayed, 10, "the stop button")
    t0 = time.time()
    stop.click()
    wait(lambda: "stopped" in chrome.find_element(By.ID, "stop-result").text, 10, "the stop")
    assert time.time() - t0 < 3.0          # the click, the request, the page (the stop itself: test_stop_*)
    wait(lambda: not chrome.find_element(By.ID, "live").is_displayed(), 15, "the badge to go")


# ---- the API's side of it: stop, fresh, the token -------------------------------------------------------------

@pytest.mark.slow
def test_a_stop_is_over_within_a_second(server):
    with server.client() as c:
        for study, when in (("stop-start", "at once"), ("stop-mid", "mid-tune")):
            r = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 200, "pool": 40, "study": study,
                                           "objective": "tg"})
            assert r.status_code == 202, r.text
            job = r.json()
            if when == "mid-tune":
                wait(lambda s=study: c.get(f"/api/studies/{s}").status_code == 200
                     and c.get(f"/api/studies/{s}").json()["counts"].get("complete", 0) >= 3, 120, "3 trials")
            else:
                time.sleep(0.3)            # the worker is importing, opening the storage, building its pool
            t0 = time.time()
            stopped = c.post(f"/api/tunes/{job['id']}/stop").json()
            took = time.time() - t0
            assert stopped["state"] == "stopped", stopped
            assert took < 1.2, (when, took)
            assert c.get(f"/api/tunes/{job['id']}").json()["state"] == "stopped"
            if when == "mid-tune":        # and the storage says nobody writes it (the badge goes at once)
                assert c.get(f"/api/studies/{study}").json()["writer"] is None
        # a stopped study resumes (the kill left nothing locked)
        again = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 2, "pool": 40, "study": "stop-mid",
                                           "objective": "tg"})
        assert again.status_code == 202, again.text
        deadline = time.time() + 120
        while c.get(f"/api/tunes/{again.json()['id']}").json()["state"] == "running" and time.time() < deadline:
            time.sleep(0.5)
        assert c.get(f"/api/tunes/{again.json()['id']}").json()["state"] == "done"


def test_fresh_needs_its_confirmation(server):
    with server.client() as c:
        n = c.get(f"/api/studies/{STUDY}").json()["n_trials"]
        r = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 1, "study": STUDY, "fresh": True})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err.startswith("offload-tuner: error: fresh: true deletes study 'web'") and "confirm_fresh" in err
        assert f"its {n} trials" in err and "\n" not in err
        r = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 1, "study": STUDY, "confirm_fresh": True})
        assert r.status_code == 400 and "goes with fresh: true" in r.json()["error"]
        r = c.post("/api/tunes", json={"model": MODEL, **HW, "trials": 1, "study": STUDY, "fresh": True,
                                       "confirm_fresh": "yes"})
        assert r.status_code == 400 and "confirm_fresh: expected true or false" in r.json()["error"]
        assert c.get(f"/api/studies/{STUDY}").json()["n_trials"] == n          # nothing deleted


def test_token_becomes_a_cookie_and_leaves_the_address(workdir, chrome):
    from selenium.webdriver.common.by import By
    token = "t0ken-for-the-web-test-5678"
    s = start_server(workdir, "--token", token)
    try:
        with s.client(follow_redirects=False) as c:
            r = c.get(f"/studies/{STUDY}?token={token}&x=1")
            assert r.status_code == 303 and r.headers["location"] == f"/studies/{STUDY}?x=1"
            assert f"offload_tuner_token={token}" in r.headers["set-cookie"]
            assert "HttpOnly" in r.headers["set-cookie"] and "SameSite=Strict" in r.headers["set-cookie"]
            r = c.get(f"//evil.example/?token={token}")
            assert r.status_code == 303 and not r.headers["location"].startswith("//")
            r = c.get("/?token=wrong-token-xxxxxxxxxx")       # the good cookie still passes; no wrong one set
            assert r.status_code == 303 and "set-cookie" not in r.headers
        with s.client(follow_redirects=False) as c:
            assert c.get("/?token=wrong-token-xxxxxxxxxx").status_code == 401
        chrome.get(f"{s.url}/?token={token}")
        assert chrome.current_url == f"{s.url}/", chrome.current_url
        assert token not in chrome.current_url
        assert chrome.find_element(By.TAG_NAME, "h1").text == "Studies"
        # the cookie carries the pages and the API calls the study page makes
        open_study(chrome, s)
        assert chrome.execute_script("return fetch('/api/health').then(r => r.status)") == 200
    finally:
        s.stop()
        chrome.delete_all_cookies()
