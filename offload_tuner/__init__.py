"""offload-tuner, the application: its use cases (app/), the command line over them (cli/) and the HTTP service
with its web view (service/). It sits on the planner's core (planner/), the autotuner (tuner/) and the engines
(runtime/, imported only inside the functions that run one); tests/test_import_graph.py holds the layers."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("offload-tuner")      # pyproject.toml's, as installed (pip install -e . included)
except PackageNotFoundError:                     # a checkout run without installing it
    __version__ = "0+unknown"
