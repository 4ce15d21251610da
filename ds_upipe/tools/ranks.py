"""Spawning local ranks: the one launcher of the tests (one spawn runs many cases), ``ds-upipe bench``
and the planner's validation.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes on a free port (gloo on CPU, or
nccl with one GPU per rank), calls ``fn(rank, world_size, *args)`` in each and returns the per-rank
return values.  Any exception on any rank fails the call with that rank's traceback; once a rank has
failed or died the others, which may be blocked in a collective, get a short grace period and are
then killed.  A rank may call ``report_progress()`` to have the parent's ``on_progress(rank)`` called
(the bench's progress bar).  The ranks' OpenMP/torch thread count is set before they start (ranks
sharing cores with spinning OpenMP threads slow down collectives several-fold), and every rank
destroys its process group, since ranks that ran collectives inside autograd can abort at exit
otherwise.

CPU (gloo) ranks are forked from a ``forkserver`` that has imported torch, DeepSpeed and transformers
once per parent process (``PRELOAD``), instead of each rank importing them again (about 4 s of CPU
per rank, most of a test spawn's cost on the 2-core test machine); the forkserver has no thread (it
only imported modules), so the fork is safe, and each rank gets the parent's environment as it is at
the spawn.  GPU (nccl) ranks are spawned fresh: a rank must not inherit a process that may have
touched CUDA, and DeepSpeed fixes its accelerator when it is imported.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.multiprocessing as mp

#: seconds the other ranks get to finish once one rank has failed or died
GRACE_S = 30.0

#: modules the forkserver of CPU ranks imports once, so that no rank imports them again (each costs
#: seconds; DeepSpeed picks its accelerator at import, so the server starts under DS_ACCELERATOR=cpu).
#: DeepSpeed's muon module is imported by every ZeRO engine's optimizer check and brings torch's
#: compiler (about 1.4 s).  None of these starts a thread (transformers.trainer would: a jemalloc
#: thread, so it is not here); a module that cannot be imported is skipped by the forkserver.
PRELOAD = (
    "torch",
    "torch.distributed",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
)


class RanksFailed(RuntimeError):
    """A rank of ``run_ranks`` raised, died or did not finish in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_rank_env(rank: int, world_size: int, port: int) -> None:
    """The environment torch.distributed / deepspeed.init_distributed read for one local rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


#: inside a rank of run_ranks: (the queue to the parent, this rank)
_TO_PARENT: list[tuple[Any, int]] = []


def report_progress() -> None:
    """Inside a rank of ``run_ranks``: one unit of work done (the parent calls ``on_progress(rank)``)."""
    if _TO_PARENT:
        channel, rank = _TO_PARENT[0]
        channel.put(("progress", rank, None))


def _worker(
    rank: int,
    world_size: int,
    port: int,
    environ: dict[str, str],
    use_deepspeed: bool,
    backend: str,
    threads: int,
    fn,
    args,
    channel,
):
    # the parent's environment at the spawn (a forkserver child starts with the server's)
    os.environ.clear()
    os.environ.update(environ)
    set_rank_env(rank, world_size, port)
    _TO_PARENT[:] = [(channel, rank)]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            from ds_upipe.cuda_env import avoid_record_streams

            avoid_record_streams(backend)  # torch < 2.8: before the group exists
            torch.cuda.set_device(rank)
        if use_deepspeed:
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend, verbose=False)
        else:
            dist.init_process_group(backend, rank=rank, world_size=world_size)
        # pickled here: the result travels as bytes, so no tensor of it is shared with a process about to exit
        channel.put(("ok", rank, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        channel.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextmanager
def _environment(**values: str) -> Iterator[None]:
    """``os.environ`` updated for the duration (what the spawned ranks inherit)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _context(backend: str) -> Any:
    """The multiprocessing context of ``backend``'s ranks (module docstring): a forkserver with the
    heavy imports done for CPU ranks, a fresh spawn for GPU ranks."""
    if backend == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the server starts: the first spawn
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    use_deepspeed: bool = False,
    backend: str = "gloo",
    threads: int = 1,
    timeout: float = 900,
    on_progress: Callable[[int], None] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local ranks; return each rank's result.

    ``use_deepspeed``: the process group comes from ``deepspeed.init_distributed`` (deepspeed.comm is
    up too).  ``backend``: "gloo" (CPU ranks, DeepSpeed's CPU accelerator) or "nccl" (rank r on GPU r).
    ``threads``: OpenMP / torch threads per rank.  ``timeout``: seconds for the whole run."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r}: must be 'gloo' or 'nccl'")
    ctx = _context(backend)
    channel = ctx.Queue()
    port = free_port()
    # set before the spawn: a spawned rank (or the forkserver, when this call starts it) sizes its OpenMP
    # pool when it first imports torch; _worker sets the thread count again, for a forkserver an earlier
    # call started with another count
    env = {"OMP_NUM_THREADS": str(threads), **({"DS_ACCELERATOR": "cpu"} if backend == "gloo" else {})}
    with _environment(**env):
        options = (dict(os.environ), use_deepspeed, backend, threads, fn, args, channel)
        procs = [ctx.Process(target=_worker, args=(r, world_size, port, *options)) for r in range(world_size)]
        for p in procs:
            p.start()
    finals: dict[int, tuple[str, int, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(finals) < world_size and time.monotonic() < deadline:
            try:
                msg = channel.get(timeout=1.0)
            except queue_mod.Empty:
                if any(p.exitcode is not None and r not in finals for r, p in enumerate(procs)):
                    deadline = min(deadline, time.monotonic() + GRACE_S)  # died without a word (e.g. killed)
                continue
            if msg[0] == "progress":
                if on_progress is not None:
                    on_progress(msg[1])
                continue
            finals[msg[1]] = msg
            if msg[0] == "error":  # the other ranks may be blocked in a collective
                deadline = min(deadline, time.monotonic() + GRACE_S)
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()) if len(finals) == world_size else 1.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    errors = [f"rank {r}:\n{m[2]}" for r, m in sorted(finals.items()) if m[0] == "error"]
    missing = [r for r in range(world_size) if r not in finals]
    if errors or missing:
        raise RanksFailed(
            "\n".join(errors)
            + (f"\nranks without a result (hung in a collective, or died): {missing}" if missing else "")
        )
    return [pickle.loads(finals[r][2]) for r in range(world_size)]
