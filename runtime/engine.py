"""The Engine protocol, BenchWorkload and Measurement: defined in planner/engine.py (the tuner uses them and
planner never imports runtime), re-exported here so the engines and their tests keep importing them from
runtime.engine."""
from planner.engine import Engine, Measurement, BenchWorkload

__all__ = ["Engine", "Measurement", "BenchWorkload"]
