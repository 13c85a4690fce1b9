"""plan, explain and inspect answered in worker processes, not in the server's threads: they are pure-Python CPU
work (a plan is ~1 s), and in threads they would hold the server's GIL against everything else it does (a study
read waiting behind four plans took 20 s on 2 busy cores). A worker process gets the CPU the OS gives it; the
server stays free to answer."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from .security import ServiceError

log = logging.getLogger(__name__)


def processes() -> int:
    """Workers: two at least (an explain need not wait behind a plan), one per two cores up to 4 (the other cores
    are the tune workers' and the server's)."""
    return max(2, min(4, (os.cpu_count() or 2) // 2))


class WorkerDied(ServiceError):
    status = 503


def answer(command: str, req: Any) -> bytes:
    """COMMAND's JSON for REQ (a request of offload_tuner/app), serialized: what runs in a worker."""
    from ..app import explain_outcome, inspect_model, plan_outcome
    from .studies import clean
    outcome = {"plan": plan_outcome, "explain": explain_outcome, "inspect": inspect_model}[command](req)
    return json.dumps(clean(outcome.to_json()), default=str).encode()


PARENT_POLL_S = 0.5      # a worker notices within this that its server is gone


def _die_with(server: int) -> None:
    """A worker's initializer: end this worker when its server (pid SERVER) is gone, kill -9 included.

    Pool workers otherwise outlive it: each waits on its call queue, whose pipe it holds both ends of, so it never
    reads an end of file (nor does the resource tracker, whose pipe they hold). planner/children.py's
    PR_SET_PDEATHSIG does not fit these: the kernel signals when the *thread* that started the child exits, and a
    ProcessPoolExecutor starts its spawned workers on whichever thread submits (here the service's worker threads,
    which anyio ends after 10 s idle: the signal would kill healthy workers). So a daemon thread watches the parent:
    once getppid() is no longer SERVER (the worker was handed to init or a subreaper), the worker exits."""
    def watch() -> None:
        while os.getppid() == server:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="die-with-server", daemon=True).start()


def _warm() -> int:
    from ..app import explain_outcome, plan_outcome  # noqa: F401  (the imports, once per worker)
    return os.getpid()


class Pool:
    """Worker processes, spawned (not forked from a threaded server), the first started at once with its imports
    done; a pool whose worker died is replaced. Each worker dies with the server (_die_with)."""

    def __init__(self, n: int):
        self.n = n
        self._lock = threading.Lock()
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.n, mp_context=multiprocessing.get_context("spawn"), initializer=_die_with,
                                   initargs=(os.getpid(),))
        pool.submit(_warm)
        return pool

    def run(self, command: str, req: Any) -> bytes:
        """answer(COMMAND, REQ) in a worker (blocking: call it from a thread); its InputError raised here."""
        pool = self._pool
        try:
            return pool.submit(answer, command, req).result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    log.warning("a %s worker died; starting new workers", command)
                    self._pool = self._start()
            raise WorkerDied(f"the worker computing this {command} died (out of memory?); retry") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Workers:
    """Plans in their pool (processes() workers), explain and inspect in one worker of their own: an explain
    (~0.1 s) never waits behind the plans of a cold start (~0.5-2 s each)."""

    def __init__(self):
        self.plans, self.quick = Pool(processes()), Pool(1)

    def run(self, command: str, req: Any) -> bytes:
        return (self.plans if command == "plan" else self.quick).run(command, req)

    def shutdown(self) -> None:
        self.plans.shutdown()
        self.quick.shutdown()
