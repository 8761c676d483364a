"""What ``zoopick serve`` runs: the API under uvicorn (one process, or several under uvicorn's
supervisor) and its local Celery workers (jobs' and datasets' tasks; webhook deliveries),
stopped together.

A stop signal reaches them all at once: uvicorn's own handler starts the API's drain (no new
connections, in-flight requests get ``ZOOPICK_SHUTDOWN_GRACE_SECONDS``), and the hook here
starts the workers' warm shutdown at the same moment, so ``serve`` exits within the grace
rather than draining the API first and only then giving the workers their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from zoopick.service.processes import (
    SUPERVISOR_ENV,
    die_with_parent,
    lowered_priority,
    stop_group,
)
from zoopick.service.queue import CPU, GPU, WEBHOOKS, worker_argv
from zoopick.service.settings import Settings

CLEANUP_SECONDS = 2.0
"""How long the requests cancelled at the stop's deadline get to clean up (an upload's
partial object removed from the store) before the API's event loop ends."""
RESTART_GRACE_SECONDS = 5.0
"""How long a worker being replaced (it exited or stopped beating) gets to stop."""
WEBHOOK_CONSUMER = {"concurrency": 1, "pool": "threads"}
"""The webhook consumer's pool: one process (no pool process forked beside it) delivering one
webhook at a time; a try is bounded by ``ZOOPICK_WEBHOOK_TIMEOUT_SECONDS``, so the threads
pool needs no time limit of Celery's."""


class LocalWorker:
    """``serve``'s local workers, each a Celery worker in its own process group (one signal
    reaches its pool and their trainers), dying with ``serve`` even if that is killed outright
    (a parent-death signal, and the worker watches our pid itself: ``workers.supervision``),
    restarted when it exits or stops beating (``liveness.LocalWorkerWatch``):

    - the worker of jobs and datasets, on ``cpu`` and ``gpu`` with ``concurrency`` pool
      processes;
    - the consumer of webhook deliveries, on ``webhooks`` alone (:data:`WEBHOOK_CONSUMER`):
      a phase's webhook is sent while every pool process of the first is busy scoring, not
      after (it waited 65 s behind scoring when one worker took both).

    Both run at a lower CPU priority than the API (``nice``: ``processes.LOCAL_WORKER_NICE``).

    Stopping is two calls: :meth:`begin_stop` at the stop signal (SIGTERM to their groups:
    their warm shutdowns run while the API drains), :meth:`stop` once the API is down (what is
    left of its ``grace`` from the signal, then SIGKILL)."""

    def __init__(self, settings: Settings, concurrency: int, nice: int, grace: float) -> None:
        self.settings, self.concurrency, self.nice, self.grace = settings, concurrency, nice, grace
        self.procs: dict[str, subprocess.Popen] = {}
        """The running workers, by the queue that names them (``cpu``, ``webhooks``)."""
        self.deadline: float | None = None
        """When the stop signal's grace ends (``time.monotonic``); None before a signal."""
        self._watch = None

    @property
    def proc(self) -> subprocess.Popen | None:
        """The worker of jobs and datasets."""
        return self.procs.get(CPU)

    def start(self) -> None:
        from zoopick.service.liveness import LocalWorkerWatch

        for queue in (CPU, WEBHOOKS):
            self.procs[queue] = self._spawn(queue)
        self._watch = LocalWorkerWatch(
            self.settings, self.restart, self.exited, watched=tuple(self.procs), pid=self._pid
        ).start()

    def _pid(self, queue: str) -> int | None:
        """The pid of the worker on ``queue``: its heartbeat row is named by it, so the watch
        tells one still starting (no row yet) from one that stopped beating."""
        proc = self.procs.get(queue)
        return proc.pid if proc is not None else None

    def _spawn(self, queue: str) -> subprocess.Popen:
        env = {**self.settings.env(), SUPERVISOR_ENV: str(os.getpid())}
        if queue == CPU:
            argv = worker_argv(f"{CPU},{GPU}", self.concurrency, loglevel="warning", exact=True)
        else:
            argv = worker_argv(WEBHOOKS, **WEBHOOK_CONSUMER, loglevel="warning")
            env["ZOOPICK_PRELOAD_SCORING"] = "false"  # it never scores: no torch in it
        # both as nice as each other: in sessions of their own, a scoring pool does not starve
        # the consumer (the scheduler shares the cores between sessions first)
        return subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            preexec_fn=lowered_priority(self.nice, die_with_parent()),
        )

    def exited(self, queue: str = CPU) -> bool:
        proc = self.procs.get(queue)
        return proc is not None and proc.poll() is not None

    def restart(self, queue: str = CPU) -> None:
        """The watch's: a new worker on ``queue`` in place of one that exited or stopped
        beating; none once ``serve`` is stopping (:meth:`stop` stops one started just
        before)."""
        if self.deadline is not None:
            return
        old = self.procs.get(queue)
        if old is not None:
            stop_group(old, grace=RESTART_GRACE_SECONDS)
        self.procs[queue] = self._spawn(queue)

    def begin_stop(self) -> None:
        """At the stop signal (called from the signal's handler: nothing here waits): SIGTERM
        each worker's main process, whose warm shutdown then has ``grace`` seconds from now
        to stop its pool; :meth:`stop` kills whatever of their groups is left after that.

        The main process alone, as Celery asks to be stopped: SIGTERM to the whole group
        reached the pool processes at the same moment, and one that died of it before the
        main process had run its own handler was logged as an error (a pool process lost
        while the worker runs), about one stop in ten on a busy machine."""
        if self.deadline is not None:  # a second signal: the first one's deadline stands
            return
        self.deadline = time.monotonic() + self.grace
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Stop watching and stop the workers: what is left of the signal's grace (all of
        ``grace`` when the API ended without one), then whatever of their groups is left is
        killed. Nothing of them keeps running."""
        if self._watch is not None:
            self._watch.stop()
        if self.deadline is None:
            self.begin_stop()
        for proc in list(self.procs.values()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        for proc in list(self.procs.values()):
            stop_group(proc, grace=0)  # past the deadline: SIGKILL


def run_api(
    settings: Settings, host: str, port: int, workers: int, on_stop: Callable[[], None]
) -> None:
    """The API until a stop signal: ``workers`` uvicorn processes (one: in this process, the
    app built from ``settings``; more: by import path under uvicorn's supervisor, reading the
    settings from the environment as a worker does). A stop drains: no new connections,
    in-flight requests get ``ZOOPICK_SHUTDOWN_GRACE_SECONDS``, then uvicorn cancels them (an
    upload still trickling in is cut and its partial file removed). ``on_stop`` is called as
    the stop signal arrives, before the drain."""
    import uvicorn

    from zoopick.app.httpcaps import PROTOCOL as HTTP_PROTOCOL  # request-head caps

    common = {
        "host": host,
        "port": port,
        "log_level": "info",
        "http": HTTP_PROTOCOL,
        "timeout_graceful_shutdown": settings.shutdown_grace_seconds,
    }
    if workers == 1:
        from zoopick.app.main import create_app

        server = _server(uvicorn.Config(create_app(settings), **common), on_stop)
        server.run()
        if not server.started:  # as uvicorn.run: the app, or its socket, failed to start
            sys.exit(uvicorn.config.STARTUP_FAILURE)
        return
    _share_settings(settings)
    config = uvicorn.Config("zoopick.app.main:create_app", factory=True, workers=workers, **common)
    _supervisor(config, on_stop).run()


def _share_settings(settings: Settings) -> None:
    """The environment of the API's processes: the settings, and a fresh folder where each
    process keeps its HTTP latency histogram for ``/metrics`` to read all of
    (prometheus_client's multiprocess mode)."""
    os.environ.update(settings.env())
    prom_dir = settings.data_dir / "prometheus"
    shutil.rmtree(prom_dir, ignore_errors=True)
    prom_dir.mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(prom_dir)


def _server(config, on_stop: Callable[[], None]):
    """A uvicorn server of one process that calls ``on_stop`` when a stop signal arrives
    (``Server.handle_exit``, uvicorn's handler of SIGTERM and SIGINT)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            on_stop()
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            # uvicorn cancels the requests still running at the grace's deadline without
            # waiting for them; the loop's end would cancel their cleanup in turn (an upload's
            # partial object left in the store): it gets a moment to run
            cancelled = list(self.server_state.tasks)
            if cancelled:
                await asyncio.wait(cancelled, timeout=CLEANUP_SECONDS)

    return Server(config=config)


def _supervisor(config, on_stop: Callable[[], None]):
    """uvicorn's supervisor of several API processes, bound to the config's socket, that
    calls ``on_stop`` when told to stop (SIGTERM, SIGINT; its handlers run on its loop)."""
    from uvicorn.supervisors import Multiprocess

    class Supervisor(Multiprocess):
        def handle_int(self) -> None:
            on_stop()
            super().handle_int()

        def handle_term(self) -> None:
            on_stop()
            super().handle_term()

    return Supervisor(config, sockets=[config.bind_socket()])
