"""offload-tuner's planner: model inventory, memory and cost models, placements and flags (no torch here)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("offload-tuner")      # pyproject.toml's, as installed (pip install -e . included)
except PackageNotFoundError:                     # a checkout run without installing it
    __version__ = "0+unknown"
