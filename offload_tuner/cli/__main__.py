"""`python -m offload_tuner.cli`: the offload-tuner command line."""
import sys

from . import main

sys.exit(main())
