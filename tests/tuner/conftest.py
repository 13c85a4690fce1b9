"""What the tuner tests share: the model and box of the sim studies, and a throwaway PostgreSQL server per test
(tests/postgres.py)."""
from __future__ import annotations

import pytest

from planner.hardware import GiB, load_hardware
from planner.presets import load_preset
from postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)


@pytest.fixture
def qwen_on_16gib():
    """(inv, hw): Qwen3-30B-A3B (Q4_K_M, its preset's default) on the gpu-box preset with one 16 GiB GPU, where a
    study has to choose which experts stay in RAM: the budget, margin, confirmation and --no-host probe studies."""
    return load_preset("Qwen3-30B-A3B:Q4_K_M").inventory(), load_hardware("gpu-box").with_vram([16 * GiB])
