"""plan, explain and inspect, as the API answers them and as the pages show them, computed in worker processes,
not in the server's threads: they are pure-Python CPU work (a plan is ~1 s), and in threads they would hold the
server's GIL against everything else it does (a study read waiting behind four plans took 20 s on 2 busy cores). A
worker process gets the CPU the OS gives it; the server stays free to answer.

Each request has a time limit: a worker still computing past it (a file that reads for ever, a plan that never
ends) is killed and replaced, and the request is answered 503 in one line; the other workers go on."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import pickle
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .security import ServiceError

log = logging.getLogger(__name__)


def processes() -> int:
    """Workers: two at least (an explain need not wait behind a plan), one per two cores up to 4 (the other cores
    are the tune workers' and the server's)."""
    return max(2, min(4, (os.cpu_count() or 2) // 2))


class WorkerDied(ServiceError):
    status = 503


class TookTooLong(ServiceError):
    status = 503


def answer(command: str, req: Any) -> bytes:
    """COMMAND's answer for REQ (a request of offload_tuner/app), serialized: what runs in a worker. plan, explain
    and inspect: their JSON; explain-page: the explain page's result as HTML (it reads the outcome itself)."""
    from ..app import explain_outcome, inspect_model, plan_outcome
    if command == "explain-page":
        from .views import explain_result
        return explain_result(explain_outcome(req)).encode()
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


def _serve(conn: Connection, server: int) -> None:
    """A worker's life: imports once, then (command, request) in, (True, bytes) or (False, exception) out, until
    its server closes the pipe or goes away."""
    _die_with(server)
    from ..app import explain_outcome, plan_outcome  # noqa: F401  (the imports, once per worker)
    while True:
        try:
            command, req = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[bool, Any] = (True, answer(command, req))
        except Exception as e:       # noqa: BLE001 (every failure goes back to the request that caused it)
            reply = (False, e)
            try:
                pickle.loads(pickle.dumps(e))        # the server must be able to read it back
            except Exception:        # noqa: BLE001 (an exception that does not travel: its words do)
                reply = (False, RuntimeError(f"{type(e).__name__}: {str(e)[:300]}"))
        conn.send(reply)


@dataclass
class _Worker:
    process: Any                 # multiprocessing.Process (spawned)
    conn: Connection

    def end(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class Pool:
    """Up to N worker processes, spawned (not forked from a threaded server) as requests need them, each answering
    one request at a time over its own pipe. A request past LIMIT_S seconds has its worker killed and replaced; a
    worker that died is replaced. Each worker dies with the server (_die_with)."""

    def __init__(self, n: int, limit_s: float):
        self.n, self.limit_s = n, limit_s
        self._context = multiprocessing.get_context("spawn")
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._started = 0            # workers alive, idle or busy
        self._closed = False
        self._idle.append(self._start())     # the first at once, its imports done before the first request

    def _start(self) -> _Worker:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(theirs, os.getpid()), name="offload-tuner-answer",
                                        daemon=True)
        process.start()
        theirs.close()
        self._started += 1
        return _Worker(process, ours)

    def _take(self) -> _Worker:
        with self._cond:
            while not self._idle and self._started >= self.n:
                self._cond.wait()
            if self._closed:
                raise WorkerDied("the server is stopping")
            return self._idle.pop() if self._idle else self._start()

    def _give_back(self, worker: _Worker | None) -> None:
        with self._cond:
            if worker is None:
                self._started -= 1
            elif self._closed:
                worker.end()
            else:
                self._idle.append(worker)
            self._cond.notify()

    def run(self, command: str, req: Any) -> bytes:
        """answer(COMMAND, REQ) in a worker (blocking: call it from a thread); its InputError raised here."""
        worker: _Worker | None = self._take()
        try:
            worker.conn.send((command, req))
            if not worker.conn.poll(self.limit_s):
                log.warning("a %s took over %.0f s; its worker is restarted", command, self.limit_s)
                worker.end()
                worker = None
                raise TookTooLong(f"this {command} took over {self.limit_s:g} s, this server's limit; its worker was "
                                  "restarted (a file that does not end? a model too large to plan here?)")
            ok, payload = worker.conn.recv()
        except (EOFError, OSError):
            if worker is not None:
                log.warning("a %s worker died; starting a new one", command)
                worker.end()
                worker = None
            raise WorkerDied(f"the worker computing this {command} died (out of memory?); retry") from None
        finally:
            self._give_back(worker)
        if ok:
            return payload
        raise payload

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for w in idle:
            w.end()


class Workers:
    """Plans in their pool (processes() workers), explain and inspect in one worker of their own: an explain
    (~0.1 s) never waits behind the plans of a cold start (~0.5-2 s each)."""

    def __init__(self, limit_s: float):
        self.plans, self.quick = Pool(processes(), limit_s), Pool(1, limit_s)

    def run(self, command: str, req: Any) -> bytes:
        return (self.plans if command == "plan" else self.quick).run(command, req)

    def shutdown(self) -> None:
        self.plans.shutdown()
        self.quick.shutdown()
