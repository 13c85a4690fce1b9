"""The service tests' fixtures live in serving.py (imported by the tests too)."""
from serving import chrome, server, workdir  # noqa: F401
