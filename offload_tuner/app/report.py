"""report: a study's plots, Markdown/HTML summary, CSV and JSON, written into a folder."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import InputError
from .requests import ReportRequest

if TYPE_CHECKING:
    from tuner.report import StudySummary

REPORT_FILES = "summary.md (and summary.html, trials.csv, report.json, PNG and SVG plots)"


@dataclass(frozen=True)
class ReportOutcome:
    """A study's report, written: its summary, where the study lives and where the files went."""
    study: str
    summary: StudySummary
    storage: str
    out: Path

    def to_json(self) -> dict[str, Any]:
        return dict(self.summary.to_dict(), storage=self.storage)


def write_report(study: Any, out: Path) -> StudySummary:
    """The report of an Optuna study into OUT; an unwritable folder is one InputError."""
    from tuner.report import write_study_report
    try:
        return write_study_report(study, out)
    except OSError as e:
        raise InputError(f"cannot write the report to {out}: {e.strerror or e}") from e


def report_study(req: ReportRequest) -> ReportOutcome:
    """The study's report, written into OUT; the study is only read (an SQLite file through a copy: read_study)."""
    from tuner.storage import default_storage, read_study
    from tuner.storage import check_output_folder, storage_errors
    storage = req.storage or default_storage(req.study)
    out = Path(req.out) if req.out else Path("reports") / req.study
    check_output_folder(out, "--out")
    with (read_study(req.study, storage) as study,
          storage_errors(storage, then="run the same command again")):   # damage quick_check missed, a server gone
        return ReportOutcome(req.study, write_report(study, out), storage, out)
