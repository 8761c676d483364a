"""Child processes the service starts (the local worker of ``zoopick serve``, a job's trainer)
and how they are stopped so that nothing outlives its parent.

Each child runs in its own process session, so one signal to its group reaches it and all of
its own children (Celery's pool, torchrun's ranks); :func:`stop_group` asks politely, then
kills whatever is left. :func:`die_with_parent` covers the case where the parent itself is
killed without a chance to clean up (SIGKILL, the out-of-memory killer).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
STOP_GRACE_SECONDS = 15.0


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
