"""Independent launches (torchrun) at the same time: a 1-process non-SP reference run next to its 2-process
SP run.  On the 2-core test machine each launch spends much of its time in one-process phases (imports,
model setup) and in collective waits, which the other launch fills: a pair took 20 s together against
30 s one after the other (TRL's plain case, measured on the shared machine).  Each launch is the same
real launch as alone, with its own rendezvous (``torchrun --standalone`` picks a free port)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path


def run_together(
    commands: list[list[str]], *, cwd: Path, env: dict[str, str], timeout: float
) -> list[tuple[int, str, float]]:
    """Start every command, wait for all; per command (exit code, stdout + stderr, wall seconds).
    A command still running at ``timeout`` (or when waiting fails) is killed, and so are the others."""
    procs: list[tuple[subprocess.Popen, Path, float]] = []
    results: list[tuple[int, str, float]] = []
    try:
        for cmd in commands:
            fd, name = tempfile.mkstemp(prefix="launch_", suffix=".log")
            with os.fdopen(fd, "w") as log:  # a file, not a pipe: no launch blocks on a full pipe
                proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
            procs.append((proc, Path(name), time.perf_counter()))
        deadline = time.monotonic() + timeout
        for proc, log, start in procs:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            results.append((code, log.read_text(), time.perf_counter() - start))
    finally:
        for proc, log, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.unlink(missing_ok=True)
    return results
