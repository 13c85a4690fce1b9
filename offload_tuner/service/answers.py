"""What each route answers, for the OpenAPI document: its success body (the keys a client can count on) and every
error status it can give, each the one line `{"error": "offload-tuner: error: ..."}` (app.py: error()).
tests/service/test_fuzz.py holds the server to these: a status or a body not written here is a failure."""
from __future__ import annotations

from typing import Any

from fastapi.responses import StreamingResponse

ERROR = {"type": "object", "required": ["error"], "additionalProperties": False,
         "properties": {"error": {"type": "string", "pattern": "^offload-tuner: error: "}}}
WHY = {400: "bad input: the CLI's one-line error", 404: "no such study or tune", 409: "a tune of that study runs",
       413: "request body too large", 415: "the body is not application/json", 429: "too many tunes running",
       503: "too many requests waiting for a compute slot; retry"}
BODY = (400, 413, 415, 503)          # a route that reads a JSON body and computes


def _obj(*required: str, **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": props}


JOB = _obj("id", "study", "storage", "state", "pid", "command", "started", "ended", "returncode", "error",
           id={"type": "string"}, study={"type": "string"}, storage={"type": "string"},
           state={"enum": ["running", "done", "failed", "stopped"]}, pid={"type": "integer"},
           command={"type": "array", "items": {"type": "string"}}, started={"type": "number"},
           ended={"type": ["number", "null"]}, returncode={"type": ["integer", "null"]}, error={"type": "string"})
ARRAY = {"type": "array"}
BODIES: dict[str, dict[str, Any]] = {
    "health": _obj("ok", "version", "engines", "storage", "max_tunes", "max_trials", "models",
                   ok={"const": True}, engines=ARRAY, models=ARRAY, max_tunes={"type": "integer"},
                   max_trials={"type": "integer"}),
    "inspect": _obj("model", "arch", "hparams", "n_tensors", "total_bytes", "groups", "layers"),
    "plan": _obj("model", "hardware", "objective", "plan", "predicted", "commands", "alternatives", "warnings",
                 alternatives=ARRAY, warnings=ARRAY),
    "explain": _obj("model", "dialect", "hardware", "plan", "predicted", "layers", "warnings", warnings=ARRAY),
    "studies": _obj("studies", "running", studies=ARRAY, running={"type": "array", "items": JOB}),
    "study": _obj("study", "settings", "n_trials", "counts", "trials", "vram_fronts", "job", trials=ARRAY,
                  n_trials={"type": "integer"}, job={"anyOf": [JOB, {"type": "null"}]}),
    "job": JOB,
    "tunes": _obj("tunes", tunes={"type": "array", "items": JOB}),
    "tune": {**JOB, "required": [*JOB["required"], "result"]},
}
# one server-sent event (app.py: _sse): a progress snapshot, or the end of a tune, its data JSON
EVENTS = {"text/event-stream": {"schema": {"type": "object", "required": ["data"], "properties": {
    "event": {"enum": ["progress", "end"]}, "data": {"type": "string", "contentMediaType": "application/json"}}}}}
# OpenAPI links: what a started tune's answer lets a client call next (schemathesis's stateful phase follows them)
JOB_ID = {"job_id": "$response.body#/id"}
FIRST_STUDY = {"name": "$response.body#/studies/0/study"}
LINKS: dict[str, dict[str, Any]] = {"studies": {
    "GetStudy": {"operationId": "study_api_studies__name__get", "parameters": FIRST_STUDY},
    "StudyEvents": {"operationId": "study_events_api_studies__name__events_get", "parameters": FIRST_STUDY},
}, "job": {
    "GetTune": {"operationId": "tune_api_tunes__job_id__get", "parameters": JOB_ID},
    "TuneEvents": {"operationId": "tune_events_api_tunes__job_id__events_get", "parameters": JOB_ID},
    "StopTune": {"operationId": "stop_tune_api_tunes__job_id__stop_post", "parameters": JOB_ID},
    "GetStudy": {"operationId": "study_api_studies__name__get", "parameters": {"name": "$response.body#/study"}},
    "StudyEvents": {"operationId": "study_events_api_studies__name__events_get",
                    "parameters": {"name": "$response.body#/study"}},
}}


def answers(body: str | None, ok: int = 200, errors: tuple[int, ...] = (), stream: bool = False) -> dict[str, Any]:
    """FastAPI's route arguments (status_code, responses) for a route answering BODY (a key of BODIES) or an
    event stream, and the error statuses ERRORS."""
    content = EVENTS if stream else {"application/json": {"schema": BODIES[body]}} if body else {}
    responses: dict[int | str, Any] = {ok: {"description": "OK", "content": content,
                                            **({"links": LINKS[body]} if body in LINKS else {})}}
    for status in errors:
        responses[status] = {"description": WHY[status], "content": {"application/json": {"schema": ERROR}}}
    return {"status_code": ok, "responses": responses, **({"response_class": StreamingResponse} if stream else {})}


def without_422(doc: dict[str, Any]) -> dict[str, Any]:
    """FastAPI documents a 422 of its own for every route with a path parameter; ours are strings, which always
    validate, and every error body is ERROR: the document keeps only the statuses written here."""
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    if "components" in doc and not schemas:
        doc["components"].pop("schemas", None)
        if not doc["components"]:
            doc.pop("components")
    return doc
