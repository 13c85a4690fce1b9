"""offload-tuner's planner: model inventory, memory and cost models, placements and flags (no torch here)."""
__version__ = "0.1.0"
