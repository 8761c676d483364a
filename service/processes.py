"""Child processes the service starts (the local worker of ``zoopick serve``, a job's trainer)
and how they are stopped so that nothing outlives its parent.

Each child runs in its own process session, so one signal to its group reaches it and all of
its own children (Celery's pool, torchrun's ranks); :func:`stop_group` asks politely, then
kills whatever is left. :func:`die_with_parent` covers the case where the parent itself is
killed without a chance to clean up (SIGKILL, the out-of-memory killer).

That signal alone does not make a Celery worker exit: it starts a *warm* shutdown, which
waits for the tasks its pool is running (a dataset bomb, a long scoring run: minutes, up to
the hard time limits), and Linux sends it when the *thread* that started the child ends, not
the process (``serve`` restarts its worker from a watch thread). So a worker that ``serve``
starts is also told ``serve``'s pid (:data:`SUPERVISOR_ENV`) and watches it itself
(:class:`SupervisorWatch`, portable): once it has been orphaned, it kills its own process
group (itself and its pool) after a short grace.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
STOP_GRACE_SECONDS = 15.0
SUPERVISOR_ENV = "ZOOPICK_SUPERVISOR_PID"
"""Environment variable naming the process a child must not outlive (``zoopick serve``)."""
ORPHAN_GRACE_SECONDS = 2.0
"""How long an orphaned worker may take to finish the warm shutdown that ``die_with_parent``'s
signal started (an idle one exits cleanly, removing its heartbeat row) before it is killed."""


def die_with_parent(parent: int | None = None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel send the child SIGTERM when ``parent`` (default:
    the calling process) dies. Linux only (None elsewhere); ``prctl`` is looked up here, so the
    forked child only makes the call."""
    import ctypes

    parent = os.getpid() if parent is None else parent
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def set_pdeathsig() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return set_pdeathsig


LOCAL_WORKER_NICE = 10
"""How much lower than ``zoopick serve`` its local worker runs (``serve --worker-nice``).

The local worker shares the API's cores. Its work (validation, scoring, fine-tuning) is
throughput work of seconds to hours; the API's is latency work of milliseconds, and a client
polls its job while that job runs. At equal priority a scoring or training worker takes the
cores from the API as often as the API takes them (issue 21, item 14). Linux weighs a nice-10
process (and a nice-10 session, see :func:`set_session_nice`) at about a ninth of a nice-0
one, so a busy worker yields most of a contended core to the API and still gets all the
cores the API leaves idle. Not 19 (or SCHED_IDLE): under a sustained API load the worker
would barely run, its heartbeat would go stale and ``serve`` would restart it as stalled. Its
pool processes and trainers inherit the value."""

AUTOGROUP = "/proc/self/autogroup"


def set_session_nice(nice: int, tries: int = 50) -> bool:
    """Make the calling process' session as nice as ``nice`` for the scheduler, where Linux
    groups processes by session (autogroup: ``/proc/sys/kernel/sched_autogroup_enabled``, on
    by default on most distributions, for processes outside a cpu cgroup of their own). There
    the cores are shared between *sessions* first, by the session's own nice value, and a
    process' nice only counts within its session: a child started with
    ``start_new_session=True`` (the local worker, a trainer) would get as much CPU as the
    API's whole session, whatever its own nice. Returns whether it was set; False without
    autogroups (the process nice is then all there is). Anyone may raise it, but without
    privileges only once per 100 ms machine-wide (EAGAIN): retried meanwhile. Safe in a
    ``preexec_fn`` (it imports nothing: a forked child must not take the import lock)."""
    for _ in range(tries):
        try:
            with open(AUTOGROUP, "w") as f:
                f.write(str(nice))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                return False
            time.sleep(0.01)
    return False


def lowered_priority(nice: int = 0, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` for a child that gets a session of its own: it runs ``nice`` steps
    nicer than its parent (0: as nice as the parent), and so does its new session where the
    scheduler groups by session (:func:`set_session_nice`), so that starting a session does
    not win back the priority the parent gave up; everything it starts inherits both. Then
    it runs ``then`` (e.g. :func:`die_with_parent`'s)."""

    def lower() -> None:
        level = os.nice(nice)
        if level > 0:
            set_session_nice(level)
        if then is not None:
            then()

    return lower


def stop_group(proc: subprocess.Popen, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM the process group led by ``proc`` (started with ``start_new_session=True``),
    wait up to ``grace`` seconds for its leader, then SIGKILL whatever of the group is left (a
    leader past its grace, or a child that outlived it). Nothing of the group keeps running."""
    if proc.poll() is not None:
        # a leader that exited on its own has settled its group (torchrun reaps its ranks);
        # killing now could cut a member off mid-way through its last words on a pipe
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    # right after the leader's exit (or still alive): the group id stays reserved while any
    # member lives, so this reaches our processes and no stranger
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class SupervisorWatch:
    """A daemon thread in a child that must not outlive ``supervisor`` (its parent): every
    ``interval`` seconds it compares ``os.getppid()`` with it; once they differ (the parent
    died and the child was re-parented, also before this watch started) it waits ``grace``
    seconds and then SIGKILLs the calling process' group when it leads one (a worker started
    with ``start_new_session=True``: itself, its pool and whatever they started in it), else
    the process alone (a Celery pool process gets SIGKILL with its parent anyway).

    Polling ``getppid`` is one cheap system call; it needs no Linux feature, and unlike a
    parent-death signal it cannot be caught and turned into a shutdown that waits."""

    def __init__(
        self,
        supervisor: int,
        interval: float = 0.5,
        grace: float = ORPHAN_GRACE_SECONDS,
        on_orphaned: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.supervisor, self.interval, self.grace = supervisor, interval, grace
        self.on_orphaned = on_orphaned
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="zoopick-supervisor", daemon=True)

    @classmethod
    def from_env(
        cls, on_orphaned: Callable[[int], None] = lambda _: None
    ) -> SupervisorWatch | None:
        """The watch named by :data:`SUPERVISOR_ENV`, if it is set (by ``zoopick serve``)."""
        raw = os.environ.get(SUPERVISOR_ENV, "")
        return cls(int(raw), on_orphaned=on_orphaned) if raw.isdigit() else None

    def start(self) -> SupervisorWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def orphaned(self) -> bool:
        return os.getppid() != self.supervisor

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.orphaned():
                self.on_orphaned(self.supervisor)
                if not self._stop.wait(self.grace):
                    kill_own_group()
                return
            self._stop.wait(self.interval)


def kill_own_group() -> None:
    """SIGKILL the calling process' group when it leads it, else the process alone."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
