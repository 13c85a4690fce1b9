"""The web view: server-rendered pages (studies, one study, explain); the study page's charts are drawn by the
vendored Chart.js (static/chart.umd.min.js) from the same JSON the API serves, and follow a running tune through
server-sent events. Nothing is loaded from another origin."""
from __future__ import annotations

import html
import json
import shlex
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from ..errors import InputError
from ..hardware import fmt_bytes
from . import bodies
from .app import one_line
from .security import NotFound

router = APIRouter(include_in_schema=False)
e = html.escape


def page(title: str, body: str, scripts: tuple[str, ...] = ()) -> HTMLResponse:
    tags = "".join(f'<script src="/static/{s}"></script>' for s in scripts)
    return HTMLResponse(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)} - offload-tuner</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/static/style.css"></head>
<body><header><a class="brand" href="/">offload-tuner</a> <a href="/">studies</a> <a href="/explain">explain</a>
<a href="/docs">API</a></header><main>{body}</main>{tags}</body></html>""")


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _gib(v: Any) -> str:
    return "-" if v is None else f"{v / 2 ** 30:.2f}"


@router.get("/")
async def index(request: Request):
    store, jobs, reads = request.app.state.store, request.app.state.jobs, request.app.state.reads
    rows = []
    for s in await reads(store.listing):
        live = jobs.for_study(s["study"])
        counts = ", ".join(f"{v} {k}" for k, v in sorted(s["counts"].items()))
        rows.append(f"<tr><td><a href=\"/studies/{e(s['study'])}\">{e(s['study'])}</a>"
                    f"{' <span class=live>running</span>' if live else ''}</td><td>{e(str(s['model']))}</td>"
                    f"<td>{e(str(s['engine']))}</td><td>{e(s['hardware'])}</td><td>{e(str(s['objective']))}</td>"
                    f"<td class=r>{s['n_trials']}</td><td>{e(counts)}</td>"
                    f"<td class=r>{_num(s.get('best_tg_tps'), '.2f')}</td>"
                    f"<td class=r>{_num(s.get('best_pp_tps'), '.1f')}</td></tr>")
    where = e(store.url or str(store.studies_dir) + "/")
    table = ("<table class=grid id=studies><thead><tr><th>study</th><th>model</th><th>engine</th><th>hardware</th>"
             "<th>objective</th><th>trials</th><th>states</th><th>best TG t/s</th><th>best PP t/s</th></tr></thead>"
             f"<tbody>{''.join(rows)}</tbody></table>" if rows else
             f"<p>No studies in {where} yet: run <code>offload-tuner demo</code> or "
             "<code>offload-tuner tune ...</code>, "
             "or POST /api/tunes.</p>")
    return page("studies", f"<h1>Studies</h1><p class=muted>storage: {where}</p>{table}")


@router.get("/studies/{name}")
async def study_page(name: str, request: Request):
    store, reads = request.app.state.store, request.app.state.reads
    try:
        body = await reads(store.derived, name, "page", lambda d: _study_body(name, d))   # once per read
    except NotFound as err:
        return page("no such study", f"<h1>No such study</h1><p class=error>{e(one_line(str(err)))}</p>")
    return page(name, body, scripts=("chart.umd.min.js", "study.js"))


def _study_body(name: str, d: dict[str, Any]) -> str:
    s = d.get("settings", {})
    budget = d.get("budget_bytes")
    head = (f"<h1>{e(name)} <span id=live class=live hidden>running</span></h1>"
            f"<p class=muted>{e(str(s.get('model')))} on {e(d['hardware_words'])}; engine {e(str(s.get('engine')))}, "
            f"objective {e(str(s.get('objective')))}, dialect {e(str(s.get('dialect')))}, "
            f"context {e(str(s.get('n_ctx')))}"
            f"; budget {e(fmt_bytes(budget)) if budget else '-'}; <span id=ntrials>{d['n_trials']}</span> trials</p>")
    charts = ("<div class=charts><figure><canvas id=chart-tg></canvas><figcaption>TG (t/s) against peak VRAM"
              "</figcaption></figure><figure><canvas id=chart-pp></canvas><figcaption>PP (t/s) against peak VRAM"
              "</figcaption></figure></div>")
    panel = ("<section id=config class=config hidden><h2 id=config-title></h2><p id=config-speeds></p>"
             "<div id=config-commands></div></section>")
    cols = [("trial", "trial"), ("state", "state"), ("source", "source"), ("label", "config"), ("tg_tps", "TG t/s"),
            ("pp_tps", "PP t/s"), ("vram_bytes", "peak VRAM GiB"), ("error", "error")]
    th = "".join(f'<th data-key="{k}">{e(t)}</th>' for k, t in cols)
    table = (f"<h2>Trials</h2><p class=muted>click a header to sort, a row to see its commands</p>"
             f"<table class=grid id=trials><thead><tr>{th}</tr></thead><tbody>{_trial_rows(d['trials'])}</tbody>"
             "</table>")
    data = json.dumps(d, default=str).replace("</", "<\\/")
    return (head + charts + panel + table +
            f'<script id=study-data type="application/json">{data}</script>')


def _trial_rows(trials: list[dict[str, Any]]) -> str:
    out = []
    for t in trials:
        out.append(f"<tr data-trial=\"{t['trial']}\"><td class=r>{t['trial']}</td><td>{e(str(t['state']))}</td>"
                   f"<td>{e(str(t.get('source') or ''))}</td><td>{e(str(t.get('label') or ''))}</td>"
                   f"<td class=r>{_num(t.get('tg_tps'), '.2f')}</td><td class=r>{_num(t.get('pp_tps'), '.1f')}</td>"
                   f"<td class=r>{_gib(t.get('vram_bytes'))}</td><td>{e(str(t.get('error') or ''))[:200]}</td></tr>")
    return "".join(out)


@router.get("/explain")
async def explain_page(request: Request, model: str = "", gpu: str = "", hardware: str = "",
                       dialect: str = "mainline", cmd: str = ""):
    form = _explain_form(model or "preset:Qwen3-30B-A3B", gpu, hardware, dialect, cmd)
    if not cmd.strip():
        return page("explain", "<h1>Explain a command line</h1>" + form)
    try:
        # the pasted line is only split into words here (shlex, as a shell would), never run
        words = shlex.split(cmd)
    except ValueError as err:
        return page("explain", "<h1>Explain a command line</h1>" + form +
                    f"<p class=error id=explain-error>{e(one_line(f'the command line does not split: {err}'))}</p>")
    body = {"model": model, "dialect": dialect, "args": words}
    if gpu.strip():
        body["gpu"] = gpu.strip()
    if hardware.strip():
        body["hardware"] = hardware.strip()
    from ..app import explain_outcome
    paths, compute = request.app.state.paths, request.app.state.compute
    try:
        o = await compute(lambda: explain_outcome(bodies.request("explain", body, paths)))
    except InputError as err:
        return page("explain", "<h1>Explain a command line</h1>" + form +
                    f"<p class=error id=explain-error>{e(one_line(str(err)))}</p>")
    return page("explain", "<h1>Explain a command line</h1>" + form + _explain_result(o))


def _explain_form(model: str, gpu: str, hardware: str, dialect: str, cmd: str) -> str:
    opts = "".join(f"<option{' selected' if d == dialect else ''}>{d}</option>" for d in ("mainline", "ik"))
    return (f"<form method=get action=/explain id=explain-form class=form>"
            f"<label>model <input name=model value=\"{e(model)}\" size=40></label>"
            f"<label>GPUs <input name=gpu value=\"{e(gpu)}\" placeholder=24GiB size=14></label>"
            f"<label>hardware <input name=hardware value=\"{e(hardware)}\" placeholder=rtx4090-ddr5 size=16></label>"
            f"<label>dialect <select name=dialect>{opts}</select></label>"
            f"<label class=wide>command line <textarea name=cmd rows=3 cols=100 "
            f"placeholder=\"llama-server -m model.gguf -ngl 99 -ot exps=CPU -c 8192\">{e(cmd)}</textarea></label>"
            f"<button type=submit>explain</button></form>")


def _explain_result(o) -> str:
    from ..app import layer_summary
    a = o.plan.assignment
    out_dev = a.get("output.weight", a.get("output_norm.weight", "CPU"))
    rows = [("token_embd", a.get("token_embd.weight", "CPU"), "-"), ("output", out_dev, "-")]
    for r in layer_summary(o.inv, a):
        span = f"blk {r['first']}" if r["first"] == r["last"] else f"blk {r['first']}-{r['last']}"
        rows.append((span, "/".join(r["dense"]), ", ".join(f"{k}:{v}" for k, v in r["experts"].items()) or "-"))
    layers = "".join(f"<tr><td>{e(x)}</td><td>{e(y)}</td><td>{e(z)}</td></tr>" for x, y, z in rows)
    budgets = {f"CUDA{i}": g.vram_bytes for i, g in enumerate(o.hw.gpus)}
    dev_rows = []
    devices = o.mem.to_dict()["devices"]
    pool = any(m["pool"] for m in devices.values())       # ik's CUDA pool: a column only where there is one
    keys = ("weights", "kv", "compute", "overhead", *(("pool",) if pool else ()), "total")
    for dev, m in devices.items():
        over = budgets.get(dev) is not None and m["total"] > budgets[dev]
        dev_rows.append(f"<tr{' class=over' if over else ''}><td>{e(dev)}</td>" +
                        "".join(f"<td class=r>{e(fmt_bytes(m[k]))}</td>" for k in keys) +
                        f"<td class=r>{e(fmt_bytes(budgets[dev])) if dev in budgets else '-'}</td></tr>")
    tensors = "".join(f"<tr><td>{e(n)}</td><td>{e(d)}</td></tr>" for n, d in sorted(a.items()))
    warns = "".join(f"<li>{e(w)}</li>" for w in o.warnings)
    return (f"<h2>Where the tensors land</h2><p class=muted>{e(o.inv.name)}; dialect {e(o.dialect)}; hardware for "
            f"the prediction: {e(o.hw.name)}</p>"
            f"<table class=grid id=layers><thead><tr><th>layers</th><th>attn+dense on</th>"
            f"<th>experts (up/gate/down)</th></tr></thead><tbody>{layers}</tbody></table>"
            f"<details><summary>every tensor ({len(a)})</summary><table class=grid id=tensors><thead><tr>"
            f"<th>tensor</th><th>device</th></tr></thead><tbody>{tensors}</tbody></table></details>"
            f"<h2>Memory per device</h2><table class=grid id=devices><thead><tr><th>device</th><th>weights</th>"
            f"<th>KV</th><th>compute</th><th>overhead</th>{'<th>pool</th>' if pool else ''}<th>total</th>"
            f"<th>budget</th></tr></thead>"
            f"<tbody>{''.join(dev_rows)}</tbody></table>"
            f"<p id=predicted>predicted: PP {o.pred.pp_tps:.1f} t/s, TG {o.pred.tg_tps:.2f} t/s</p>"
            + (f"<h2>Warnings</h2><ul id=warnings>{warns}</ul>" if warns else ""))
