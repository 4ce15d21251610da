"""A clean end for sequence-parallel processes: DeepSpeed's CPU shm-allreduce segment is released.

Under the ``deepspeed`` launcher (which sets ``LOCAL_SIZE``) on a CPU accelerator,
``deepspeed.init_distributed`` creates one shared-memory segment per rank,
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (66 MB, written in
full, so it holds host memory), and DeepSpeed never removes it (deepspeed/ops/csrc/cpu/comm/shm.cpp:
``shared_close`` is never called).  Every launch leaves its segments behind; they pile up in RAM, and
a later launch on the same port maps a stale peer's segment.  ``ds_upipe.initialize`` therefore
unlinks the job's segments at exit (also on the launcher's SIGTERM, and those of killed peers).
Unlinking is safe once every rank has finished its own ``init_distributed``: peers keep their
mapping, only the name goes (they open peers' segments once, at init).  That holds after any
collective on the world group has completed, so the release is registered only after
``deepspeed.initialize`` returned.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from pathlib import Path
from typing import Any, NoReturn

SHM_DIR = Path("/dev/shm")
#: whether the exit path is installed: process-level because what it installs is (signal handlers and
#: the atexit hook belong to the process); it only removes this process's shm segments at exit
_REGISTERED: list[bool] = []


def shm_allreduce_segment(rank: int | None = None) -> Path | None:
    """This rank's DeepSpeed shm-allreduce segment path, or None when DeepSpeed creates none here."""
    env = os.environ
    local_size = env.get("LOCAL_SIZE")
    world_size = env.get("WORLD_SIZE")
    if local_size is None or local_size != world_size:  # shm.cpp uses shm only when all ranks are local
        return None
    rank = int(env.get("RANK", "0")) if rank is None else rank
    name = f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_{env.get('MASTER_PORT', '')}_{rank}"
    return SHM_DIR / name


def release_shm_allreduce_segment() -> None:
    """Remove the segment names of every rank of this job (no-op where DeepSpeed creates none).

    Every rank's, not only this one's: a rank that was killed cannot remove its own, and once all
    ranks are past ``init_distributed`` no rank opens a name again (see the module docstring), so
    whichever rank exits first may remove them all; the others' ``missing_ok`` unlinks are no-ops."""
    if shm_allreduce_segment() is None:
        return
    for rank in range(int(os.environ["WORLD_SIZE"])):
        path = shm_allreduce_segment(rank)
        if path is not None:
            path.unlink(missing_ok=True)


def release_shm_at_exit() -> None:
    """Release the segments at interpreter exit and on SIGTERM, once per process.

    SIGTERM is how the ``deepspeed`` launcher stops the surviving ranks when one rank fails
    (launcher/launch.py, ``sigkill_handler``); Python's default action for it runs no atexit
    handler, so the segments are released in a handler that then hands the signal on to the one
    installed before (or to the default action).  Call only after a collective over all ranks has
    completed (see the module docstring)."""
    if _REGISTERED:
        return
    atexit.register(release_shm_allreduce_segment)
    if threading.current_thread() is threading.main_thread():  # signal handlers: main thread only
        previous = signal.getsignal(signal.SIGTERM)

        def release_then_terminate(signum: int, frame: Any) -> None:
            release_shm_allreduce_segment()
            if callable(previous):
                previous(signum, frame)
                return
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, release_then_terminate)
    _REGISTERED.append(True)


def exit_process(code: int = 0) -> NoReturn:
    """End a distributed worker process now, with ``code``, without interpreter finalization.

    Why: a gloo worker thread can still hold the last reference to a finished collective's work
    object (and so to tensors owned by Python objects) after the collective returned; if it drops
    it once interpreter finalization has begun, it needs the GIL, is killed by Python, and the
    process aborts with "terminate called without an active exception" (SIGABRT) although the job
    succeeded (seen in 2 of ~40 ``accelerate launch`` runs on a loaded 2-core machine; the core
    dump shows ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` -> ``pthread_exit``
    in ``ProcessGroupGloo::runLoop`` while the main thread is in ``Py_FinalizeEx``).
    ``destroy_process_group`` does not stop gloo's worker threads, so no amount of cleanup makes
    finalization safe.  Here, while the interpreter is fully alive, a barrier (every rank is past
    ``init_distributed``, so the shm segment can go, also after a configuration error) precedes the
    destruction of the process groups; then the atexit handlers run (logging, trackers) and output
    is flushed, and the process ends without finalization, so the race cannot happen.
    """
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:  # every rank is here, so past init_distributed: the shm segment can go (see above)
            dist.barrier()
            release_shm_allreduce_segment()
        except RuntimeError:  # a peer is gone (its error is the job's result): its segment can go too
            release_shm_allreduce_segment()
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to deliver
            pass
    os._exit(code)
