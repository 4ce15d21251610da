"""Independent launches (torchrun, accelerate) at the same time: a 1-process non-SP reference run next to
its 2-process SP run, and, through ``run_pool``, a file's launches kept a few processes deep.  On the
2-core test machine each launch spends much of its time in one-process phases (the launcher's own
imports, rendezvous, model setup) and in collective waits, which the other launches fill: a pair took
20 s together against 30 s one after the other (TRL's plain case), two 2-process Trainer launches 27 s
together against 32 to 42 s one after the other (a launch alone: 16 s wall for 17 s of CPU on 2 cores;
measured on the shared machine).  Each launch is the same real launch as alone, with its own rendezvous
(``torchrun --standalone`` picks a free port)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

#: processes (launch ranks) a pool keeps running at once: 2 per core on the 2-core test machine
POOL_PROCS = 4


def run_together(
    commands: list[list[str]], *, cwd: Path, env: dict[str, str], timeout: float
) -> list[tuple[int, str, float]]:
    """Start every command, wait for all; per command (exit code, stdout + stderr, wall seconds).
    A command still running at ``timeout`` (or when waiting fails) is killed, and so are the others."""
    return run_pool([(cmd, 1) for cmd in commands], cwd=cwd, env=env, timeout=timeout, max_procs=len(commands))


def run_pool(
    launches: list[tuple[list[str], int]],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    max_procs: int = POOL_PROCS,
) -> list[tuple[int, str, float]]:
    """Run ``(command, ranks)`` launches, each started (in list order, the first that fits) once the
    ranks of the launches running and its own fit in ``max_procs`` (a launch always starts on an idle
    pool); per launch, in list order, (exit code, stdout + stderr, wall seconds).  At ``timeout`` for
    the whole pool (or when waiting fails) every launch still running is killed."""
    pending = list(range(len(launches)))
    running: dict[int, tuple[subprocess.Popen, Path, float]] = {}
    results: dict[int, tuple[int, str, float]] = {}
    deadline = time.monotonic() + timeout
    try:
        while pending or running:
            busy = sum(launches[i][1] for i in running)
            for i in list(pending):
                if not running or busy + launches[i][1] <= max_procs:
                    fd, name = tempfile.mkstemp(prefix="launch_", suffix=".log")
                    with os.fdopen(fd, "w") as log:  # a file, not a pipe: no launch blocks on a full pipe
                        proc = subprocess.Popen(
                            launches[i][0], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
                        )
                    running[i] = (proc, Path(name), time.perf_counter())
                    pending.remove(i)
                    busy += launches[i][1]
            for i, (proc, log, start) in list(running.items()):
                if proc.poll() is not None:
                    results[i] = (proc.returncode, log.read_text(), time.perf_counter() - start)
                    log.unlink(missing_ok=True)
                    del running[i]
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(launches[next(iter(running))][0], timeout)
            if running:
                time.sleep(0.1)
    finally:
        for proc, log, _ in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.unlink(missing_ok=True)
    return [results[i] for i in range(len(launches))]
