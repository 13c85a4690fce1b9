"""The application layer: offload-tuner's use cases, each a function from a typed request to a typed outcome.

    inspect_model(InspectRequest) -> InspectOutcome        plan_outcome(PlanRequest) -> PlanOutcome
    explain_outcome(ExplainRequest) -> ExplainOutcome      report_study(ReportRequest) -> ReportOutcome
    start_tune(TuneRequest) -> TuneOutcome (start or resume; SIGINT, SIGTERM, SIGHUP stop it: TuneInterrupted)
    demo_options(DemoRequest) -> TuneRequest, then start_tune     check_server(ServerConfig): serve's checks

Requests are frozen dataclasses (requests.py), their fields' types and help read by the CLI and the service alike
(fields.py); outcomes carry what the text printer needs and a to_json() that `--json` prints and the service
answers. cli/ parses argv into requests and prints outcomes; service/ validates JSON into the same requests and
serialises the outcomes; neither imports the other. Imports run one way: planner/ and tuner/ <- app/ <- cli/,
service/ (tests/test_import_graph.py)."""
from __future__ import annotations

from .demo import clear_demo_study, demo_options
from .explain import ExplainOutcome, explain_outcome, layer_summary
from .inspect import InspectOutcome, inspect_model
from .plan import TOOLS, Commands, PlanOutcome, commands_for, plan_outcome
from .report import ReportOutcome, report_study, write_report
from .requests import (DEMO, DemoRequest, ExplainRequest, InspectRequest, PlanRequest, ReportRequest, ServerConfig,
                       TuneRequest, parse_kv_types)
from .serve import check_server
from .tune import (TuneInputs, TuneInterrupted, TuneOutcome, load_engine, start_tune,
                   tune_inputs)

__all__ = ["DEMO", "TOOLS", "Commands", "DemoRequest", "ExplainOutcome", "ExplainRequest",
           "InspectOutcome", "InspectRequest", "PlanOutcome", "PlanRequest", "ReportOutcome", "ReportRequest",
           "ServerConfig", "TuneInputs", "TuneInterrupted", "TuneRequest", "TuneOutcome", "check_server",
           "clear_demo_study", "commands_for", "demo_options", "explain_outcome", "inspect_model", "layer_summary",
           "load_engine", "parse_kv_types", "plan_outcome", "report_study", "start_tune",
           "tune_inputs", "write_report"]
