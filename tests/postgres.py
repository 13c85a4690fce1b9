"""A throwaway PostgreSQL server per test (initdb in a temporary folder, Unix socket only, trust auth), stopped
after; skipped where initdb and pg_ctl or the psycopg driver are missing. The tuner's storage tests and the
service's use it (each folder's conftest imports the fixtures)."""
from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PostgresServer:
    url: str              # the form the README shows
    pg_ctl: list[str]     # pg_ctl -D DATA, as the user the server runs as

    def restart(self) -> None:
        """Stop the server (fast: open connections are cut) and start it again, waiting until it answers."""
        subprocess.run(self.pg_ctl + ["-m", "fast", "-w", "restart"], check=True, capture_output=True, timeout=120)


@pytest.fixture
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of its own (initdb in a temporary folder, Unix socket only, trust auth), stopped after."""
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if not (initdb and pg_ctl):
        pytest.skip("no PostgreSQL server here (initdb and pg_ctl not on PATH)")
    pytest.importorskip("psycopg",
                        reason="the PostgreSQL driver (pip install 'offload-tuner[postgres]') is not installed")
    run_as: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="pg"))        # short: a Unix socket path is at most 107 bytes
    if os.geteuid() == 0:                               # the server refuses to run as root
        runuser = shutil.which("runuser")
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            user = None
        if not (runuser and user):
            shutil.rmtree(folder, ignore_errors=True)
            pytest.skip("running as root, and no 'postgres' user and runuser to start the server with")
        os.chown(folder, user.pw_uid, user.pw_gid)
        run_as = [runuser, "-u", "postgres", "--"]
    data, port = folder / "data", _free_port()
    ctl = run_as + [pg_ctl, "-D", str(data), "-o", f"-k {folder} -p {port} -c listen_addresses=''", "-l",
                    str(folder / "log")]
    try:
        subprocess.run(run_as + [initdb, "-D", str(data), "-U", "tuner", "--auth=trust"], check=True,
                       capture_output=True, timeout=120)
        subprocess.run(ctl + ["-w", "start"], check=True, capture_output=True, timeout=60)
        yield PostgresServer(f"postgresql://tuner@/postgres?host={folder}&port={port}", ctl)
    finally:
        subprocess.run(run_as + [pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    return postgres_server.url
