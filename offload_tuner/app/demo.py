"""demo: the main job on the embedded default: a fresh sim-engine study, its report and the best flags."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from planner.errors import InputError
from .requests import DEMO, DemoRequest, TuneRequest


def demo_options(req: DemoRequest) -> TuneRequest:
    """The demo's study (the built-in one, or the spec's) with the request's trials and pool, always fresh."""
    from offload_tuner.app.studyspec import load_spec
    base = TuneRequest(**load_spec(req.spec)) if req.spec else DEMO
    return replace(base, fresh=True, quiet=req.quiet, trials=req.trials if req.trials is not None else base.trials,
                   pool=req.pool if req.pool is not None else base.pool)


def clear_demo_study(opts: TuneRequest) -> None:
    """Deletes the demo study's SQLite files, so repeated demos agree, after checking that the folders it writes
    into are folders."""
    from offload_tuner.app.studyspec import storage_beside
    from tuner.storage import default_storage, sqlite_path
    storage = opts.storage or (storage_beside(opts.spec, opts.study) if opts.spec else default_storage(opts.study))
    db = sqlite_path(storage)
    for folder in ({db.parent} if db else set()) | {Path("reports")}:
        if folder.exists() and not folder.is_dir():
            raise InputError(f"demo writes into {folder}/, but {folder} here is a file; run it in another folder")
    for suffix in ("", "-wal", "-shm", "-journal") if db else ():
        Path(f"{db}{suffix}").unlink(missing_ok=True)
