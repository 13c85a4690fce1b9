"""`python -m planner.cli`: the offload-tuner command line."""
import sys

from . import main

sys.exit(main())
