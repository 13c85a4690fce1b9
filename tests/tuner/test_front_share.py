"""report's front share (the share of engine runs near the placement front) in one pass over the runs sorted by
VRAM: the same figure as the filter per run it replaced (the web view asks for it on every trial of a study)."""
from __future__ import annotations

import random

import pandas as pd

from tuner.report import _front_share


def _per_run(df: pd.DataFrame) -> float | None:
    """The definition, run by run: within 10% of the best TG or PP measured at no more VRAM."""
    runs = df[df["engine_run"] & df["ok"] & df["vram_bytes"].notna()]
    if runs.empty:
        return None
    near = 0
    for _, r in runs.iterrows():
        cheaper = runs[runs["vram_bytes"] <= r["vram_bytes"]]
        if r["tg_tps"] >= 0.9 * cheaper["tg_tps"].max() or r["pp_tps"] >= 0.9 * cheaper["pp_tps"].max():
            near += 1
    return near / len(runs)


def test_one_pass_is_the_definition_on_random_studies():
    rng = random.Random(31)
    for _ in range(200):
        n = rng.randint(0, 25)

        def speed():
            return float("nan") if rng.random() < 0.15 else rng.choice([rng.random() * 100, 50.0, 10.0])
        df = pd.DataFrame({
            "engine_run": [rng.random() < 0.8 for _ in range(n)], "ok": [rng.random() < 0.8 for _ in range(n)],
            # equal VRAM on purpose (ties count as "no more"), some unknown
            "vram_bytes": [float("nan") if rng.random() < 0.1 else float(rng.choice([1, 2, 3, rng.randint(1, 99)]))
                           for _ in range(n)],
            "tg_tps": [speed() for _ in range(n)], "pp_tps": [speed() for _ in range(n)]})
        df = df.astype({"engine_run": bool, "ok": bool, "vram_bytes": float, "tg_tps": float, "pp_tps": float})
        assert _front_share(df, None) == _per_run(df)
