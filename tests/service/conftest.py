"""The service tests' fixtures live in serving.py (imported by the tests too)."""
from postgres import postgres_server  # noqa: F401
from serving import chrome, server, workdir  # noqa: F401
