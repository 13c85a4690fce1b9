"""`report`: plots, Markdown/HTML summary, CSV and JSON of a study."""
from __future__ import annotations

import argparse

from .common import _emit_json, _write_report


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path
    from ..tuner.search import default_storage, load_study
    storage = args.storage or default_storage(args.study)
    out = Path(args.out) if args.out else Path("reports") / args.study
    from ..tuner.storage import check_output_folder
    check_output_folder(out, "--out")
    study = load_study(args.study, storage)
    s = _write_report(study, out)
    if args.json:
        _emit_json(dict(s.to_dict(), storage=storage))
        return 0
    counts = ", ".join(f"{v} {k}" for k, v in sorted(s.counts.items()))
    print(f"study {args.study}: {s.n_trials} trials ({counts})")
    for k, r in s.best.items():
        if r:
            print(f"best {k}: TG {r['tg_tps']:.2f} t/s, PP {r['pp_tps']:.1f} t/s (trial {r['trial']}, {r['label']})")
            if r["commands"].get("llama-server"):
                print(f"  {r['commands']['llama-server']}")
    print(f"report: {out}/summary.md (and summary.html, trials.csv, report.json, PNG and SVG plots)")
    return 0


def add_parser(sub) -> None:
    """Registers `report` and its options."""
    p = sub.add_parser("report", help="plots, Markdown/HTML summary, CSV and JSON of a study")
    p.add_argument("study")
    p.add_argument("--storage", help="SQLAlchemy URL (default sqlite:///studies/STUDY.db)")
    p.add_argument("--out", help="folder (default reports/STUDY)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)
