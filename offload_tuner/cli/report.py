"""`report`: plots, Markdown/HTML summary, CSV and JSON of a study."""
from __future__ import annotations

import argparse

from tuner.report import shown_dict, shown_paths
from ..app.report import REPORT_FILES, report_study
from ..app.requests import ReportRequest
from .common import emit_json, add_option, add_positional, request


def cmd_report(args: argparse.Namespace) -> int:
    o = report_study(request(ReportRequest, args))
    model = o.summary.settings.model
    if args.json:      # as report.json says it: files by their names; the storage is where the study is
        emit_json(dict(shown_dict(o.to_json(), model), storage=o.storage))
        return 0
    s = o.summary
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s.counts.items()))
    print(f"study {o.study}: {s.n_trials} trials ({counts})")
    if s.no_result:
        print(s.no_result)
    for k, r in s.best.items():
        if r:
            seconds = (f"{r['mean_request_s']:.2f} s per mean request ({r['value']:.4g} t/s of the workload), "
                       if r.get("mean_request_s") is not None else "")      # a time study's best, as time
            print(f"best {k}: {seconds}TG {r['tg_tps']:.2f} t/s, PP {r['pp_tps']:.1f} t/s (trial {r['trial']}, "
                  f"{r['label']})")
            if r["commands"].get("llama-server"):     # the model by its file name: it is pasted where the model is
                print(f"  {shown_paths(r['commands']['llama-server'], model)}")
    print(f"report: {o.out}/{REPORT_FILES}")
    return 0


def add_parser(sub) -> None:
    """Registers `report` and its options."""
    p = sub.add_parser("report", help="plots, Markdown/HTML summary, CSV and JSON of a study")
    add_positional(p, ReportRequest, "study")
    add_option(p, ReportRequest, "storage")
    add_option(p, ReportRequest, "out")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)
