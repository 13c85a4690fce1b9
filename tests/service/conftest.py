"""The service tests' fixtures live in serving.py (imported by the tests too)."""
from serving import server, workdir  # noqa: F401
