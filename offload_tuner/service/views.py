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

from planner.errors import InputError, error_line
from planner.hardware import fmt_bytes
from . import bodies
from .security import NotFound

router = APIRouter(include_in_schema=False)
e = html.escape


def page(title: str, body: str, scripts: tuple[str, ...] = ("common.js",), refresh_s: int | None = None
         ) -> HTMLResponse:
    tags = "".join(f'<script src="/static/{s}"></script>' for s in scripts)
    again = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return HTMLResponse(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{e(title)} - offload-tuner</title>
<meta name="viewport" content="width=device-width, initial-scale=1">{again}
<link rel="stylesheet" href="/static/style.css"></head>
<body><header><a class="brand" href="/">offload-tuner</a> <a href="/">studies</a> <a href="/plan">plan</a>
<a href="/explain">explain</a> <a href="/#tune">tune</a> <a href="/docs">API</a></header><main>{body}</main>{tags}
</body></html>""")


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _gib(v: Any) -> str:
    return "-" if v is None else f"{v / 2 ** 30:.2f}"


@router.get("/")
async def index(request: Request):
    store, jobs, reads = request.app.state.store, request.app.state.jobs, request.app.state.reads
    rows = []
    for s in await reads(store.listing):
        live = jobs.for_study(s["study"]) or s.get("writer")
        counts = dict(s["counts"])
        waiting = counts.pop("waiting", 0)
        rows.append(f"<tr data-study=\"{e(s['study'])}\"><td><a href=\"/studies/{e(s['study'])}\">{e(s['study'])}</a>"
                    f"{' <span class=live>running</span>' if live else ''}</td><td>{e(str(s['model']))}</td>"
                    f"<td>{e(str(s['engine']))}</td><td>{e(s['hardware'])}</td><td>{e(str(s['objective']))}</td>"
                    f"<td class=r>{s['n_trials'] - waiting}</td><td>{_states(counts, waiting, live)}</td>"
                    f"<td class=r>{_num(s.get('best_tg_tps'), '.2f')}</td>"
                    f"<td class=r>{_num(s.get('best_pp_tps'), '.1f')}</td></tr>")
    where = e(store.shown)
    table = ("<table class=grid id=studies><thead><tr><th>study</th><th>model</th><th>engine</th><th>hardware</th>"
             "<th>objective</th><th>trials</th><th>states</th><th>best TG t/s</th><th>best PP t/s</th></tr></thead>"
             f"<tbody>{''.join(rows)}</tbody></table>" if rows else
             f"<p>No studies in {where} yet: run <code>offload-tuner demo</code> or "
             "<code>offload-tuner tune ...</code>, "
             "or start one below.</p>")
    config = request.app.state.config
    return page("studies", f"<h1>Studies</h1><p class=muted>storage: {where}</p>{table}" + _tune_form(config),
                scripts=("common.js", "forms.js"))


def _states(counts: dict[str, int], waiting: int, live: Any) -> str:
    text = e(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if waiting:       # enqueued trials are not runs: they run only if a tune takes the study up again
        text += f" <span class=queued>({waiting} queued{'' if live else ', not run'})</span>"
    return text


OBJECTIVES = ("time", "tg", "pp", "both")      # time first: the default of plan and tune, the workload's mean request


def _workload_fields(config, workload: str = "", file: str = "") -> str:
    """The workload: a preset (the default: chat under time), and where the server has --models folders a .toml or
    .jsonl under them (workload_file; a file anywhere else is the server's, never read on a request's word)."""
    from planner.workload import PRESETS
    loads = "".join(f"<option value=\"{e(w)}\"{' selected' if w == workload else ''}>{e(w or 'default (chat)')}"
                    "</option>" for w in ("", *PRESETS))
    out = f"<label>workload <select name=workload>{loads}</select></label>"
    if config.model_dirs:
        out += (f"<label>workload file <input name=workload_file value=\"{e(file)}\" size=24 "
                "placeholder=\"a .toml or .jsonl under --models\"></label>")
    return out


def _tune_form(config) -> str:
    engines = "".join(f"<option>{e(x)}</option>" for x in config.engines)
    objectives = "".join(f"<option>{x}</option>" for x in OBJECTIVES)
    return ("<h2 id=tune>Start a tune</h2><p class=muted>runs <code>offload-tuner tune ...</code> in a worker of this "
            f"server (at most {config.max_tunes} at once, {config.max_trials} trials each); the study page follows "
            "it live and has its stop button</p>"
            "<form id=tune-form class=form>"
            "<label>model <input name=model value=\"preset:Qwen3-30B-A3B\" size=32 required></label>"
            "<label>GPUs <input name=gpu placeholder=24GiB size=10></label>"
            "<label>hardware <input name=hardware placeholder=rtx4090-ddr5 size=14></label>"
            f"<label>engine <select name=engine>{engines}</select></label>"
            f"<label>objective <select name=objective>{objectives}</select></label>"
            + _workload_fields(config) +
            "<label>TTFT limit <input name=ttft placeholder=\"e.g. 3s (time)\" size=10></label>"
            "<label>trials <input name=trials type=number min=1 value=30 size=5></label>"
            "<label>study <input name=study placeholder=\"(from model and hardware)\" size=20></label>"
            "<label class=check><input name=fresh type=checkbox> fresh (delete the study of that name first)</label>"
            "<label class=check><input name=confirm_fresh type=checkbox> yes, delete it</label>"
            "<button type=submit>start</button></form><p class=error id=tune-error></p>")


@router.get("/studies/{name}")
async def study_page(name: str, request: Request):
    store, reads, jobs = request.app.state.store, request.app.state.reads, request.app.state.jobs
    job = jobs.for_study(name)
    try:       # the same page for every client, built once per read
        body, writer = await reads(store.derived, name, "page", lambda d: _study_body(name, d))
    except NotFound as err:
        if job is not None:       # a tune this server just started: its worker has not made the study yet
            return page(name, f"<h1>{e(name)} <span class=live>starting</span></h1><p>The tune's worker is "
                              "creating the study; this page reloads in 2 s.</p>", refresh_s=2)
        return page("no such study", f"<h1>No such study</h1><p class=error>{e(error_line(str(err)))}</p>")
    # who writes the study and this server's job (the stop button) as they are now, never kept with the page
    live = json.dumps({"writer": writer, "job": job.to_json() if job else None}, default=str).replace("</", "<\\/")
    return page(name, body + f'<script id=study-live type="application/json">{live}</script>',
                scripts=("common.js", "chart.umd.min.js", "study.js"))


def _study_body(name: str, d: dict[str, Any]) -> str:
    """The study's page without who writes it (study-live, added per request: study_page)."""
    s = d.get("settings", {})
    budget = d.get("budget_bytes")
    waiting = int(d.get("counts", {}).get("waiting", 0))
    head = (f"<h1>{e(name)} <span id=live class=live hidden>running</span> "
            "<button id=stop type=button hidden>stop</button> <span id=stop-result class=muted></span></h1>"
            f"<p class=muted>{e(str(s.get('model')))} on {e(d['hardware_words'])}; engine {e(str(s.get('engine')))}, "
            f"objective {e(str(s.get('objective')))}{_time_words(s)}, dialect {e(str(s.get('dialect')))}, "
            f"context {e(str(s.get('n_ctx')))}"
            f"; budget {e(fmt_bytes(budget)) if budget else '-'}; <span id=ntrials>{d['n_trials'] - waiting}</span> "
            "trials (<span id=counts></span>)</p>")
    answer = "<section id=answer class=answer></section>"
    charts = ("<div class=charts><figure><div class=chart-box><canvas id=chart-tg></canvas></div><figcaption>TG (t/s) "
              "against peak VRAM</figcaption></figure><figure><div class=chart-box><canvas id=chart-pp></canvas>"
              "</div><figcaption>PP (t/s) against peak VRAM</figcaption></figure></div>")
    panel = ("<section id=config class=config hidden><h2 id=config-title></h2><p id=config-speeds></p>"
             "<div id=config-commands></div></section>")
    cols = [("trial", "trial"), ("state", "state"), ("source", "source"), ("label", "config"), ("tg_tps", "TG t/s"),
            ("pp_tps", "PP t/s"), ("vram_bytes", "peak VRAM GiB"), ("error", "error")]
    th = "".join(f'<th data-key="{k}">{e(t)}</th>' for k, t in cols)
    plain = "".join(f"<th>{e(t)}</th>" for _, t in cols)
    table = (f"<h2>Trials</h2><p class=muted>click a header to sort, a row to see its commands</p>"
             f"<table class=grid id=trials><thead><tr>{th}</tr></thead><tbody>{_trial_rows(d['trials'])}</tbody>"
             "</table>"
             "<section id=unrun-box hidden><h2>Not run: <span id=unrun-n>0</span> trials</h2>"
             "<p class=muted id=unrun-why></p>"
             f"<table class=grid id=unrun><thead><tr>{plain}</tr></thead><tbody></tbody></table></section>")
    data = json.dumps(d, default=str).replace("</", "<\\/")
    return (head + answer + charts + panel + table +
            f'<script id=study-data type="application/json">{data}</script>')


def _time_words(settings: dict[str, Any]) -> str:
    """What a time study's objective means, beside its name: seconds per mean request (it stores tokens per
    second)."""
    if settings.get("objective") != "time":
        return ""
    name = (settings.get("requests") or {}).get("name", "the workload")
    return f" ({e(str(name))}: seconds per mean request, lower is better)"


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
                       dialect: str = "mainline", cmd: str = "", ram: str = ""):
    form = _explain_form(model or "preset:Qwen3-30B-A3B", gpu, hardware, dialect, cmd, ram)
    if not cmd.strip():
        return page("explain", "<h1>Explain a command line</h1>" + form)
    try:
        # the pasted line is only split into words here (shlex, as a shell would), never run
        words = shlex.split(cmd)
    except ValueError as err:
        return page("explain", "<h1>Explain a command line</h1>" + form +
                    f"<p class=error id=explain-error>{e(error_line(f'the command line does not split: {err}'))}</p>")
    body = {"model": model, "dialect": dialect, "args": words}
    if gpu.strip():
        body["gpu"] = gpu.strip()
    if hardware.strip():
        body["hardware"] = hardware.strip()
    if ram.strip():
        body["ram"] = ram.strip()
    state = request.app.state
    try:       # in a worker, like the API's explain (workers.py: explain-page renders the result there)
        result = await state.compute(lambda: state.workers.run("explain-page", bodies.request("explain", body,
                                                                                            state.paths)))
    except InputError as err:
        return page("explain", "<h1>Explain a command line</h1>" + form +
                    f"<p class=error id=explain-error>{e(error_line(str(err)))}</p>")
    return page("explain", "<h1>Explain a command line</h1>" + form + result.decode())


def _explain_form(model: str, gpu: str, hardware: str, dialect: str, cmd: str, ram: str = "") -> str:
    opts = "".join(f"<option{' selected' if d == dialect else ''}>{d}</option>" for d in ("mainline", "ik"))
    return (f"<form method=get action=/explain id=explain-form class=form>"
            f"<label>model <input name=model value=\"{e(model)}\" size=40></label>"
            f"<label>GPUs <input name=gpu value=\"{e(gpu)}\" placeholder=24GiB size=14></label>"
            f"<label>hardware <input name=hardware value=\"{e(hardware)}\" placeholder=rtx4090-ddr5 size=16></label>"
            + _ram_field(ram) +
            f"<label>dialect <select name=dialect>{opts}</select></label>"
            f"<label class=wide>command line <textarea name=cmd rows=3 cols=100 "
            f"placeholder=\"llama-server -m model.gguf -ngl 99 -ot exps=CPU -c 8192\">{e(cmd)}</textarea></label>"
            f"<button type=submit>explain</button></form>")


def explain_result(o) -> str:
    from ..app import layer_summary
    a = o.plan.assignment
    out_dev = a.get("output.weight", a.get("output_norm.weight", "CPU"))
    rows = [("token_embd", a.get("token_embd.weight", "CPU"), "-"), ("output", out_dev, "-")]
    for r in layer_summary(o.inv, a):
        span = f"blk {r['first']}" if r["first"] == r["last"] else f"blk {r['first']}-{r['last']}"
        rows.append((span, "/".join(r["dense"]), ", ".join(f"{k}:{v}" for k, v in r["experts"].items()) or "-"))
    layers = "".join(f"<tr><td>{e(x)}</td><td>{e(y)}</td><td>{e(z)}</td></tr>" for x, y, z in rows)
    # a command as the user runs it, against the whole card (explain's over-the-card warning): not a plan's budget,
    # which keeps memory free on each GPU
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
            f"<th>card</th></tr></thead>"
            f"<tbody>{''.join(dev_rows)}</tbody></table>"
            + host_table(o.host.to_dict() if o.host is not None else None, "host") +
            f"<p id=predicted>predicted: PP {o.pred.pp_tps:.1f} t/s, TG {o.pred.tg_tps:.2f} t/s</p>"
            + (f"<h2>Warnings</h2><ul id=warnings>{warns}</ul>" if warns else ""))


@router.get("/docs")
async def docs_page(request: Request):
    """The API's reference from its OpenAPI document (/openapi.json), rendered here: no swagger-ui, no CDN, so it
    reads the same offline."""
    spec = request.app.openapi()
    out = [f"<h1>HTTP API <span class=muted>{e(str(spec.get('info', {}).get('version', '')))}</span></h1>",
           f"<p>{e(str(spec.get('info', {}).get('description', '')))} Every error is one line, "
           "<code>{\"error\": \"offload-tuner: error: ...\"}</code>, with a 4xx status. The machine-readable "
           "document: <a href=\"/openapi.json\">/openapi.json</a>.</p>", "<ul id=api-index>"]
    ops = [(path, method, op) for path, item in spec.get("paths", {}).items() for method, op in item.items()]
    for path, method, op in ops:
        out.append(f"<li><a href=\"#{e(_anchor(method, path))}\"><code>{e(method.upper())} {e(path)}</code></a> "
                   f"{e(op.get('summary', ''))}</li>")
    out.append("</ul>")
    for path, method, op in ops:
        out.append(f"<section class=endpoint id=\"{e(_anchor(method, path))}\"><h2><code>{e(method.upper())} "
                   f"{e(path)}</code></h2><p>{e(op.get('summary', ''))}</p>")
        params = [p for p in op.get("parameters", []) if isinstance(p, dict)]
        if params:
            out.append("<p>parameters: " + ", ".join(f"<code>{e(p.get('name', ''))}</code> ({e(p.get('in', ''))})"
                                                     for p in params) + "</p>")
        schema = (op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema"))
        if schema and schema.get("properties"):
            req = set(schema.get("required", []))
            rows = "".join(f"<tr><td><code>{e(k)}</code>{' <b>required</b>' if k in req else ''}</td>"
                           f"<td>{e(_schema_type(v))}</td><td>{e(str(v.get('description', '')))}</td></tr>"
                           for k, v in schema["properties"].items())
            out.append("<p>JSON body (application/json; other keys are refused):</p><table class=grid>"
                       f"<thead><tr><th>key</th><th>type</th><th>meaning</th></tr></thead><tbody>{rows}</tbody>"
                       "</table>")
        out.append("</section>")
    return page("API", "".join(out))


def _anchor(method: str, path: str) -> str:
    return method + "-" + "".join(c if c.isalnum() else "-" for c in path).strip("-")


def _schema_type(v: dict[str, Any]) -> str:
    if "enum" in v:
        return " | ".join(str(x) for x in v["enum"])
    if "oneOf" in v:
        return " or ".join(_schema_type(x) for x in v["oneOf"])
    if v.get("type") == "array":
        return f"list of {_schema_type(v.get('items', {}))}"
    return str(v.get("type", "any"))


@router.get("/plan")
async def plan_page(request: Request, model: str = "", gpu: str = "", hardware: str = "", dialect: str = "mainline",
                    ctx: str = "", objective: str = "time", workload: str = "", workload_file: str = "",
                    ram: str = ""):
    config = request.app.state.config
    form = _plan_form(model or "preset:Qwen3-30B-A3B", gpu, hardware, dialect, ctx, objective,
                      _workload_fields(config, workload, workload_file), ram=ram)
    title = "<h1>Plan a placement</h1>"
    if not model.strip():
        return page("plan", title + form)
    body: dict[str, Any] = {"model": model.strip(), "dialect": dialect, "objective": objective}
    for key, value in (("gpu", gpu), ("hardware", hardware), ("ram", ram), ("ctx", ctx),
                       ("workload", workload_file or workload)):
        if value.strip():
            body[key] = value.strip()
    state = request.app.state
    try:       # in a worker, the API's plan (its JSON is what the page shows)
        o = json.loads(await state.compute(lambda: state.workers.run("plan", bodies.request("plan", body,
                                                                                               state.paths))))
    except InputError as err:
        return page("plan", title + form + f"<p class=error id=plan-error>{e(error_line(str(err)))}</p>")
    return page("plan", title + form + _plan_result(o))


def _plan_form(model: str, gpu: str, hardware: str, dialect: str, ctx: str, objective: str, workload: str,
               ram: str = "") -> str:
    dialects = "".join(f"<option{' selected' if d == dialect else ''}>{d}</option>" for d in ("mainline", "ik"))
    objectives = "".join(f"<option{' selected' if o == objective else ''}>{o}</option>" for o in OBJECTIVES)
    return (f"<form method=get action=/plan id=plan-form class=form>"
            f"<label>model <input name=model value=\"{e(model)}\" size=40></label>"
            f"<label>GPUs <input name=gpu value=\"{e(gpu)}\" placeholder=24GiB size=14></label>"
            f"<label>hardware <input name=hardware value=\"{e(hardware)}\" placeholder=rtx4090-ddr5 size=16></label>"
            + _ram_field(ram) +
            f"<label>dialect <select name=dialect>{dialects}</select></label>"
            f"<label>context <input name=ctx value=\"{e(ctx)}\" placeholder=8192 size=8></label>"
            f"<label>objective <select name=objective>{objectives}</select></label>"
            f"{workload}<button type=submit>plan</button></form>")


def _ram_field(ram: str) -> str:
    return (f"<label>RAM <input name=ram value=\"{e(ram)}\" placeholder=\"128GiB (default: the server's)\" "
            "size=14></label>")


def host_table(h: dict[str, Any] | None, table_id: str) -> str:
    """The host's row in parts (planner/host.py HostBill.to_dict()): weights in RAM mmap'd and pinned, KV and
    compute on the CPU, llama-server's prompt cache at its --cache-ram, the process, against the RAM."""
    if not h:
        return ""
    cache = f" (--cache-ram {h['cache_ram_mib']})" if h.get("cache_ram_mib") is not None else ""
    rows = [("weights mmap'd", h["weights_mapped"]), ("weights pinned", h["weights_pinned"]), ("KV", h["kv"]),
            ("compute", h["compute"]), (f"prompt cache{cache}", h["prompt_cache"]), ("process", h["process"]),
            ("total", h["total"]), ("RAM", h["ram"])]
    if h["shortfall"]:
        rows.append(("short", h["shortfall"]))
    body = "".join(f"<tr{' class=over' if k == 'short' else ''}><td>{e(k)}</td><td class=r>{e(fmt_bytes(v))}</td>"
                   "</tr>" for k, v in rows)
    return (f"<h2>Host RAM</h2><table class=grid id={table_id}><thead><tr><th>part</th><th>bytes</th></tr></thead>"
            f"<tbody>{body}</tbody></table>")


def _plan_result(o: dict[str, Any]) -> str:
    budgets = o.get("budgets") or {}
    dev_rows = []
    for dev, m in o.get("devices", {}).items():
        cap = budgets.get(dev)
        dev_rows.append(f"<tr><td>{e(dev)}</td>" + "".join(f"<td class=r>{e(fmt_bytes(m[k]))}</td>" for k in
                                                           ("weights", "kv", "compute", "overhead", "total")) +
                        f"<td class=r>{e(fmt_bytes(cap)) if cap else '-'}</td></tr>")
    p = o.get("predicted", {})
    cmds = json.dumps(o.get("commands", {}))
    alts = "".join(f"<tr><td>{e(a['label'])}</td><td>{'mmap' if a.get('mmap') else 'no mmap'}"
                   f"{', op offload' if a.get('op_offload') else ''}</td><td class=r>{a['tg_tps']:.2f}</td>"
                   f"<td class=r>{a['pp_tps']:.1f}</td>"
                   + (f"<td class=r>{a['mean_request_s']:.2f}</td>" if "mean_request_s" in a else "") +
                   f"<td class=r>{e(', '.join(fmt_bytes(v) for v in a['gpu_bytes'].values()))}</td></tr>"
                   for a in o.get("alternatives", []))
    warns = "".join(f"<li>{e(w)}</li>" for w in o.get("warnings", []))
    cannot = "".join(f"<li>{e(k)}: {e(v)}</li>" for k, v in o.get("not_expressible", {}).items())
    first = f"<strong id=plan-gives-up>{e(o['gives_up'])}</strong>: " if o.get("gives_up") else ""
    times = "<th>request s</th>" if "mean_request_s" in p else ""
    return (f"<h2>Best predicted placement</h2><p id=plan-predicted>{e(o['model'])} on {e(o['hardware'])}, objective "
            f"{e(str(o['objective']))}: {first}predicted TG {p.get('tg_tps', 0):.2f} t/s, PP {p.get('pp_tps', 0):.1f} "
            "t/s"
            + (f", mean request {p['mean_request_s']:.2f} s" if "mean_request_s" in p else "") + "</p>"
            f"<div id=plan-commands class=commands data-commands=\"{e(cmds)}\"></div>"
            + (f"<ul class=muted>{cannot}</ul>" if cannot else "") +
            "<h2>Memory per device</h2><table class=grid id=plan-devices><thead><tr><th>device</th><th>weights</th>"
            "<th>KV</th><th>compute</th><th>overhead</th><th>total</th><th>room</th></tr></thead>"
            f"<tbody>{''.join(dev_rows)}</tbody></table>" + host_table(o.get("host_ram"), "plan-host")
            + (f"<h2>Warnings</h2><ul id=warnings>{warns}</ul>" if warns else "")
            + ("<h2>Other candidates</h2><table class=grid id=plan-alternatives><thead><tr><th>placement</th><th>knobs"
               f"</th><th>TG t/s</th><th>PP t/s</th>{times}<th>GPU memory</th></tr></thead><tbody>{alts}</tbody>"
               "</table>"
               if alts else ""))
