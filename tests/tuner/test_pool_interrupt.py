"""A study's start builds its candidate pool for seconds (hundreds of decodes) before any engine run: a Ctrl-C or a
service's stop (SIGINT) noted then ends it at the next candidate, not after the whole pool (issue 29, item 4: a
stop honoured within a second while a tune starts)."""
from __future__ import annotations

import random

import pytest

from tuner.interrupt import SIGINT
from tuner.pool import Pool


class CountingSpace:
    def __init__(self):
        self.decoded = 0

    def random(self, rng):
        return {}

    def decode(self, params):
        self.decoded += 1
        if self.decoded == 3:
            SIGINT.pending = True          # what the handler does when the signal lands mid-build
        return type("C", (), {"fits": False})()


def test_pool_build_stops_at_the_next_candidate():
    space = CountingSpace()
    with SIGINT.guard(), pytest.raises(KeyboardInterrupt):
        Pool(lambda plan: None, random.Random(0)).build(space, 500)
    assert space.decoded == 3


def test_pool_build_without_the_guard_runs_through():
    space = CountingSpace()
    Pool(lambda plan: None, random.Random(0)).build(space, 50)
    assert space.decoded == 50
    SIGINT.pending = False
