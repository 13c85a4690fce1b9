"""The routes: /api/* answers what the CLI's --json prints (the same use cases of offload_tuner/app make it, from the
same requests: bodies.py), / and below are the web view (views.py). Every error is one line, `offload-tuner:
error: ...` as the CLI prints it, with a 4xx status; an unexpected one is logged here and answered 500 with one
line, never a traceback."""
from __future__ import annotations

import asyncio
import json
import logging
import shutil
import tempfile
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any
from collections.abc import Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..app import ServerConfig
from ..app.serve import check_bind, is_loopback
from planner.engine_registry import spec
from planner.errors import InputError, error_line
from tuner.storage import shown_url
from . import bodies
from .answers import BODY, answers, without_422
from .jobs import Jobs
from .memo import Memo
from .workers import Workers
from .security import TOKEN_COOKIE, PathPolicy, ServiceError, TooLarge, Unsupported, host_ok, token_ok
from .studies import STUDY_NAME, StorageBusy, StudyStore, clean

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
EVENT_INTERVAL_S = 1.0
READ_THREADS = 4                 # study reads at once (their own threads: a read never waits behind a plan)
PROGRESS_THREADS = 2             # the event streams' progress reads at once (one per study at a time: Latest)
KEEPALIVE_S = 15.0


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": error_line(message)}, status_code=status)


def as_json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(clean(obj), default=str), status_code=status, media_type="application/json")


class Guard:
    """ASGI middleware: Host check on loopback, the token (header, cookie, or ?token= once, which sets the
    cookie for the pages), and the body bound (Content-Length up front, streamed bodies as they arrive)."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config
        self.loopback = is_loopback(config.host)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not host_ok(headers.get("host"), self.loopback):
            return await error(421, f"Host {headers.get('host', '')[:100]!r} is not served here (the server "
                                    "answers loopback names only)")(scope, receive, send)
        set_cookie = None
        if self.config.token:
            from urllib.parse import parse_qs
            q = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [None])[0]
            auth = headers.get("authorization", "")
            bearer = auth[7:] if auth.lower().startswith("bearer ") else None
            cookie = _cookie(headers.get("cookie", ""), TOKEN_COOKIE)
            if not any(token_ok(self.config.token, t) for t in (bearer, cookie, q)):
                return await error(401, "this server needs its token: Authorization: Bearer TOKEN (or open "
                                        "/?token=TOKEN once in the browser)")(scope, receive, send)
            if q is not None and cookie != q and token_ok(self.config.token, q):   # never a wrong one over a good
                set_cookie = f"{TOKEN_COOKIE}={q}; HttpOnly; SameSite=Strict; Path=/"
            if q is not None and scope.get("method") in ("GET", "HEAD") and not scope["path"].startswith("/api/"):
                # a page opened with ?token=T: the cookie, and the same address without the token (history, the
                # address bar, a Referer and a screenshot no longer show it)
                return await _without_token(scope, set_cookie)(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.config.max_body):
            return await error(413, f"request body over {self.config.max_body} bytes")(scope, receive, send)
        seen = 0

        async def bounded_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.config.max_body:
                    raise TooLarge(f"request body over {self.config.max_body} bytes")
            return msg

        async def send_with_cookie(msg):
            if set_cookie and msg["type"] == "http.response.start":
                msg = dict(msg, headers=[*msg.get("headers", []), (b"set-cookie", set_cookie.encode())])
            await send(msg)
        return await self.app(scope, bounded_receive, send_with_cookie)


def _without_token(scope, set_cookie: str | None) -> Response:
    from urllib.parse import parse_qsl, quote, urlencode
    rest = [(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
            if k != "token"]
    path = "/" + quote(scope.get("path", "/"), safe="/:@!$&'()*+,;=-._~").lstrip("/")   # never //host: off-site
    where = path + (f"?{urlencode(rest)}" if rest else "")
    headers = {"Location": where, "Cache-Control": "no-store", "Referrer-Policy": "no-referrer"}
    if set_cookie:
        headers["Set-Cookie"] = set_cookie
    return Response(status_code=303, headers=headers)


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v
    return None


class Compute:
    """Work off the event loop, in worker threads, THREADS at a time: the rest wait, and past max_waiting a request
    is told to come back (503) rather than queueing without bound. Two of them: plan/explain/inspect (CPU-bound:
    config.compute_threads) and the study reads (quick once kept, studies.py: READ_THREADS), so that a read never
    waits behind a plan."""

    def __init__(self, threads: int, max_waiting: int):
        self.limiter = anyio.CapacityLimiter(threads)
        self.max_waiting = max_waiting
        self.waiting = 0

    async def __call__(self, fn: Callable, *args: Any) -> Any:
        if self.waiting >= self.max_waiting:
            raise Overloaded(f"{self.waiting} requests are waiting already; retry in a moment")
        self.waiting += 1
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        finally:
            self.waiting -= 1


class Overloaded(ServiceError):
    status = 503


class Latest:
    """A study's progress as the event streams read it: one read at a time per study, shared by every stream that
    asks meanwhile, and kept for MAX_AGE_S: fifty streams of one study cost one read a second, not fifty, and a
    stream that connects gets the kept snapshot at once rather than a place in the read queue."""

    def __init__(self, read: Callable[[str], Any], max_age_s: float):
        self.read, self.max_age_s = read, max_age_s
        self._kept: dict[str, tuple[float, Any]] = {}
        self._reading: dict[str, asyncio.Future] = {}

    async def get(self, name: str) -> Any:
        kept = self._kept.get(name)
        if kept is not None and time.monotonic() - kept[0] < self.max_age_s:
            return kept[1]
        future = self._reading.get(name)
        if future is None:
            future = self._reading[name] = asyncio.ensure_future(self._read(name))
        return await asyncio.shield(future)       # a stream that goes away cancels only its own wait

    async def _read(self, name: str) -> Any:
        try:
            value = await self.read(name)
            self._kept[name] = (time.monotonic(), value)
            return value
        finally:
            del self._reading[name]


async def read_json(request: Request) -> Any:
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        # a cross-site form can post text/plain without a preflight; JSON only, so it cannot
        raise Unsupported(f"send the body as application/json (got {ctype or 'no content type'})")
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise InputError(f"the request body is not JSON: {str(e)[:120]}") from None


CONFIRM_FRESH = "confirm_fresh"
CONFIRM_FRESH_DOC = {"type": "boolean", "description": "with fresh: true, says yes to deleting the study of that "
                                                       "name (every trial) before the tune; fresh is refused "
                                                       "without it"}


def _doc(command: str, summary: str, limits: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """OpenAPI for a body read by hand (bodies.py, not pydantic, checks it and words the errors as the CLI does)."""
    schema = bodies.schema(command, limits)
    if command == "tune":
        schema["properties"][CONFIRM_FRESH] = CONFIRM_FRESH_DOC
    return {"summary": summary, "openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema, "example": bodies.EXAMPLES[command]}}}}}


def fresh_confirmed(body: Any) -> bool:
    """Take the confirmation of fresh out of a tune's BODY (it is the service's, not one of tune's options)."""
    if not isinstance(body, dict):
        return False
    given = [body.pop(k) for k in (CONFIRM_FRESH, "confirm-fresh") if k in body]
    if any(not isinstance(v, bool) for v in given):
        raise InputError(f"{CONFIRM_FRESH}: expected true or false")
    return any(given)


# one piece: FastAPI's routes are closures over the one app's state (store, jobs, paths); each is a few lines
def create_app(config: ServerConfig) -> FastAPI:
    config.studies_dir.mkdir(parents=True, exist_ok=True)
    state_dir = Path(tempfile.mkdtemp(prefix="offload-tuner-serve-"))
    store = StudyStore(config.storage, config.studies_dir.resolve())
    jobs = Jobs(config, state_dir)
    paths = PathPolicy(config.model_dirs)
    compute = Compute(config.compute_threads, config.max_waiting)
    reads = Compute(READ_THREADS, config.max_waiting)
    memo = Memo()
    # the event streams' reads in threads of their own: a stream's first event never waits behind the study
    # reads (a summary is ~0.5 s cold), and Latest makes them one read a second per study however many watch
    progress_reads = Compute(PROGRESS_THREADS, config.max_waiting)
    latest = Latest(lambda name: progress_reads(store.progress, name), EVENT_INTERVAL_S)
    workers = Workers(config.request_limit_s)
    threading.Thread(target=_warm_up, name="warm-up", daemon=True).start()

    @asynccontextmanager
    async def lifespan(app):
        yield
        workers.shutdown()
        await anyio.to_thread.run_sync(jobs.shutdown)
        shutil.rmtree(state_dir, ignore_errors=True)      # the tune workers' logs: this server's alone

    # /docs is the package's own page (views.py: the OpenAPI document as HTML), not swagger-ui from a CDN
    app = FastAPI(title="offload-tuner", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="The CLI's --json over HTTP: plan, explain, inspect, studies and tunes.")
    app.state.config, app.state.store, app.state.jobs = config, store, jobs
    app.state.paths, app.state.compute, app.state.reads, app.state.memo = paths, compute, reads, memo
    app.state.workers = workers
    fastapi_openapi = app.openapi
    app.openapi = lambda: app.openapi_schema or without_422(fastapi_openapi())

    @app.exception_handler(InputError)
    async def _input_error(request: Request, e: InputError):
        return error(getattr(e, "status", 400), str(e))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return error(422, f"{where}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        response = error(e.status_code, str(e.detail))
        if e.status_code == 405:      # every method of the path (Starlette names only the first route's)
            response.headers["Allow"] = ", ".join(_methods(app, request.scope))
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error(500, f"internal error ({type(e).__name__}); the server log has the details")

    async def run_command(request: Request, command: str) -> Response:
        body = await read_json(request)

        def work() -> bytes:
            req = bodies.request(command, body, paths)
            return memo.get(command, req, lambda: workers.run(command, req))
        return Response(await compute(work), media_type="application/json")

    @app.get("/api/health", summary="liveness, version, what this server allows", **answers("health"))
    async def health():
        return as_json({"ok": True, "version": _version(), "engines": list(config.engines),
                        "storage": shown_url(config.storage or f"sqlite:///{config.studies_dir}/STUDY.db"),
                        "max_tunes": config.max_tunes, "max_trials": config.max_trials,
                        "models": [str(p) for p in paths.roots],
                        "answers_kept": {"hits": memo.hits, "misses": memo.misses}})

    @app.post("/api/inspect", **_doc("inspect", "offload-tuner inspect MODEL --json"),
              **answers("inspect", errors=BODY))
    async def inspect(request: Request):
        return await run_command(request, "inspect")

    @app.post("/api/plan", **_doc("plan", "offload-tuner plan MODEL ... --json"), **answers("plan", errors=BODY))
    async def plan(request: Request):
        return await run_command(request, "plan")

    @app.post("/api/explain", **_doc("explain", "offload-tuner explain MODEL ... --json -- ARGS"),
              **answers("explain", errors=BODY))
    async def explain(request: Request):
        return await run_command(request, "explain")

    @app.get("/api/studies", summary="every study in the server's storage, with counts and best speeds",
             **answers("studies", errors=(503,)))
    async def studies():
        return as_json({"studies": await reads(store.listing),
                        "running": [j.to_json() for j in jobs.running()]})

    @app.get("/api/studies/{name}", summary="one study: report --json's summary (best, fronts, baselines, ratios) "
                                            "plus every trial", **answers("study", errors=(404, 503)))
    async def study(name: str):
        detail, writer = await reads(store.derived, name, "json", lambda d: json.dumps(d, default=str).encode())
        job = jobs.for_study(name)
        # the kept JSON (a study of hundreds of trials: serialized once per read, not per request) plus who writes
        # the study and this server's job, both as they are now
        live = json.dumps(clean({"writer": writer, "job": job.to_json() if job else None})).encode()
        return Response(detail[:-1] + b", " + live[1:], media_type="application/json")

    @app.get("/api/studies/{name}/events", summary="server-sent progress events of a study (live while a tune "
                                                   "runs)", **answers(None, errors=(404, 503), stream=True))
    async def study_events(name: str, request: Request):
        await latest.get(name)                # 404 now, not inside the stream (and the first event's read done)
        return _sse(request, name, None)

    server_limits = {"trials": {"maximum": config.max_trials}, "engine": {"enum": list(config.engines)}}

    @app.post("/api/tunes", **_doc("tune", "start offload-tuner tune ... --json in a worker", server_limits),
              **answers("job", 202, errors=(*BODY, 409, 429)))
    async def start_tune(request: Request):
        from ..app import tune_inputs
        body = await read_json(request)
        confirmed = fresh_confirmed(body)

        def check():
            opts = bodies.request("tune", body, paths)     # TuneRequest, with the defaults the CLI's have
            if confirmed and not opts.fresh:
                raise InputError(f"{CONFIRM_FRESH} goes with fresh: true (it confirms deleting the study)")
            if opts.engine not in config.engines:
                raise InputError(f"engine {opts.engine} is not enabled on this server (engines here: "
                                 f"{', '.join(config.engines)}); the server's --engine says which run")
            if opts.trials > config.max_trials:
                raise InputError(f"--trials {opts.trials}: this server runs at most {config.max_trials} per tune")
            inputs = tune_inputs(opts)       # tune's own checks, before a worker starts
            if not STUDY_NAME.fullmatch(inputs.study):
                raise InputError(f"study name {inputs.study[:120]!r}: letters, digits, '.', '_' and '-' only")
            if opts.fresh and not confirmed:
                # one POST must not wipe a study of hours: the deletion is said out loud
                name = inputs.study
                n = store.progress(name)["n_trials"] if store.exists(name) else None
                held = f" and its {n} trials" if n is not None else " (there is none yet)"
                raise InputError(f"fresh: true deletes study {name!r}{held} before the tune; send "
                                 f"\"{CONFIRM_FRESH}\": true with it to confirm")
            return opts, inputs.study
        opts, name = await compute(check)
        storage = store.storage_for_new(name)
        # the worker's own options: JSON out, no bar, no report; the study, its storage and binary the server's
        worker = replace(opts, study=name, storage=storage, json=True, quiet=True, no_report=True,
                         llama_bench=config.llama_bench if spec(opts.engine).traits.binary == "llama-bench" else None)
        job = jobs.start(worker, name, storage)
        return as_json(job.to_json(), 202)

    @app.get("/api/tunes", summary="tunes this server started", **answers("tunes"))
    async def tunes():
        return as_json({"tunes": [j.to_json() for j in jobs.all()]})

    @app.get("/api/tunes/{job_id}", summary="one tune: state, command, error, and tune --json's output when done",
             **answers("tune", errors=(404,)))
    async def tune(job_id: str):
        job = jobs.get(job_id)
        return as_json(dict(job.to_json(), result=job.result()))

    @app.post("/api/tunes/{job_id}/stop", summary="stop a tune within a second (SIGINT, then SIGKILL; finished "
                                                           "trials are kept, resumable)",
              **answers("job", errors=(404,)))
    async def stop_tune(job_id: str):
        job = await anyio.to_thread.run_sync(jobs.stop, job_id)     # over within a second (Jobs.stop)
        return as_json(job.to_json())

    @app.get("/api/tunes/{job_id}/events", summary="server-sent progress events of a tune, until it ends",
             **answers(None, errors=(404, 503), stream=True))
    async def tune_events(job_id: str, request: Request):
        job = jobs.get(job_id)
        return _sse(request, job.study, job)

    def _sse(request: Request, name: str, job) -> StreamingResponse:
        async def stream():
            last, quiet_since = None, anyio.current_time()
            while not await request.is_disconnected():
                try:
                    snap = await latest.get(name)
                except (StorageBusy, Overloaded):      # this time only: the next tick asks again
                    await anyio.sleep(EVENT_INTERVAL_S)
                    continue
                except InputError:      # the worker has not created the study yet
                    snap = {"n_trials": 0, "counts": {}}
                live = job or jobs.for_study(name)
                snap = dict(snap, study=name, job=live.to_json() if live else None)
                if snap != last:
                    yield f"event: progress\ndata: {json.dumps(clean(snap))}\n\n"
                    last, quiet_since = snap, anyio.current_time()
                elif anyio.current_time() - quiet_since > KEEPALIVE_S:
                    yield ": keep-alive\n\n"
                    quiet_since = anyio.current_time()
                if job is not None and job.state != "running":
                    yield f"event: end\ndata: {json.dumps(clean(job.to_json()))}\n\n"
                    return
                await anyio.sleep(EVENT_INTERVAL_S)
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    from .views import router
    app.include_router(router)
    return Guard(app, config)


WARM_UP = ("pandas", "optuna", "sqlalchemy.orm", "optuna.storages._rdb.storage", "tuner.report",
           "tuner.records", "tuner.storage")      # what a study read needs (workers.py: a plan's)


def _warm_up() -> None:
    """The imports the first study read would wait for (pandas, optuna and SQLAlchemy take seconds on a busy
    machine), made once at start, in the background."""
    import importlib
    for name in WARM_UP:
        try:
            importlib.import_module(name)
        except ImportError as e:       # the request that needs it says so
            log.debug("warm-up: %s", e)


def _methods(app: FastAPI, scope) -> list[str]:
    """The methods the routes of SCOPE's path take."""
    from starlette.routing import Match
    methods = set()
    for route in app.router.routes:
        if getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return sorted(methods)


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("offload-tuner")
    except Exception:
        return "0"


class NoQuery(logging.Filter):
    """uvicorn's access lines without their query strings: a first visit's ?token= (and a form's values) never
    reach the log. The access record's args are (client, method, path with query, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
        return True


def serve(config: ServerConfig) -> None:
    """Run uvicorn on the app (blocking): the CLI's `serve`, after offload_tuner/app/serve.py's check_server."""
    import uvicorn
    check_bind(config.host, config.token)
    # our loggers' level and handler are the CLI's (-v / -q, offload_tuner/cli/logs.py); uvicorn keeps its own,
    # configured when its Config is made: the access log's filter goes on after that
    server = uvicorn.Config(create_app(config), host=config.host, port=config.port, log_level="info",
                            timeout_graceful_shutdown=10, limit_concurrency=512)
    logging.getLogger("uvicorn.access").addFilter(NoQuery())
    uvicorn.Server(server).run()
