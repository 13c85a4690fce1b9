"""The HTTP API fuzzed from its own OpenAPI document (schemathesis, its engine: what `st run` runs) against a real
`offload-tuner serve`: every operation with data the schema allows and data it does not (the document's examples,
then boundary values, then random bodies), then stateful sequences along the document's links (a started tune ->
its state, events, stop; the study list -> a study). Checked on every answer: no 5xx, the status, content type,
headers and body as documented, invalid data refused, no request over its timeout. The number of requests sent is
printed and written to reports/service/fuzz.json.

One check is off: schema-valid data is not always accepted, and cannot be: whether a plan fits, whether a build
matches the dialect, whether llama.cpp takes the arguments are answers of the use cases (a documented 400), not of
the schema. What one field alone refuses, the schema says (offload_tuner/service/bodies.py: BOUNDS)."""
from __future__ import annotations

import json
import shutil
import time

import pytest
import schemathesis
from schemathesis.engine import from_schema
from schemathesis.engine.events import FatalError, NonFatalError, ScenarioFinished

from serving import SCREENSHOTS, start_server

MAX_EXAMPLES = 15          # random bodies per operation and mode (the boundary values come on top)
REQUEST_TIMEOUT_S = 30     # the biggest preset's plan on 2 busy cores takes a few seconds
REFUSED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]   # 413: over max_body
CONFIG = {
    "seed": 31,
    "generation": {"mode": "all", "max-examples": MAX_EXAMPLES, "database": "none"},
    "checks": {"enabled": True, "positive_data_acceptance": {"enabled": False},
               "negative_data_rejection": {"expected-statuses": REFUSED},
               "max_response_time": REQUEST_TIMEOUT_S},
    "request-timeout": REQUEST_TIMEOUT_S,
    "max-stream-events": 1,       # a progress stream: its first event is enough
    "phases": {"stateful": {"max-steps": 20}},
}


def fuzz(url: str) -> dict:
    """Run every phase against URL's document; the requests by status, the failures and the engine's errors."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=schemathesis.Config.from_dict(CONFIG))
    sent: dict[str, int] = {}

    @schema.hook
    def after_call(context, case, response):
        sent[str(response.status_code)] = sent.get(str(response.status_code), 0) + 1

    failures, errors, scenarios = set(), [], 0
    for event in from_schema(schema).execute():
        if isinstance(event, ScenarioFinished):
            scenarios += 1
            for checks in event.recorder.checks.values():
                failures |= {f"{event.recorder.label}: {c.failure_info.failure.title}: "
                             f"{c.failure_info.failure.message[:300]}" for c in checks if c.failure_info}
        elif isinstance(event, NonFatalError):
            errors.append(f"{event.label}: {event.info.format()[:500]}")
        elif isinstance(event, FatalError):
            raise event.exception
    return {"schemathesis": schemathesis.__version__, "requests": sum(sent.values()),
            "by_status": dict(sorted(sent.items())), "scenarios": scenarios,
            "server_errors": sum(n for s, n in sent.items() if s.startswith("5")),
            "failures": sorted(failures), "errors": errors}


@pytest.mark.slow
def test_the_api_against_its_own_document(workdir, tmp_path_factory, capsys):
    # a server of its own (the tunes the fuzz starts must not show in the other tests' studies), tunes of 3 trials
    d = tmp_path_factory.mktemp("fuzz") / "serve"
    shutil.copytree(workdir, d, ignore=shutil.ignore_patterns("serve-*.log"))
    server = start_server(d, "--models", str(d / "models"), "--max-trials", "3")
    try:
        t0 = time.perf_counter()
        figures = fuzz(server.url)
        figures["wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        server.stop()
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / "fuzz.json").write_text(json.dumps(figures, indent=2) + "\n")
    with capsys.disabled():
        print(f"\nfuzz: {figures['requests']} requests {figures['by_status']}, {len(figures['failures'])} failures, "
              f"{len(figures['errors'])} errors, {figures['wall_s']} s (schemathesis {figures['schemathesis']})")
    assert not figures["failures"] and not figures["errors"], json.dumps(figures, indent=1)
    assert figures["server_errors"] == 0 and figures["requests"] > 500, figures
    log = server.log.read_text()
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
