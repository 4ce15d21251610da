"""Spawning local ranks: the multi-process CPU harness of the tests (one spawn runs many cases) and
the port and environment that ``ds-upipe bench`` uses for its own ranks.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes over gloo on a free port, calls
``fn(rank, world_size, *args)`` in each and returns the per-rank return values.  Any exception on
any rank fails the call with that rank's traceback.  Processes set OMP_NUM_THREADS=1 (two cores
shared by up to four ranks) and always destroy the process group, since ranks that ran collectives
inside autograd can abort at exit otherwise.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


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


def _worker(rank: int, world_size: int, port: int, use_deepspeed: bool, fn, args, results) -> None:
    set_rank_env(rank, world_size, port)
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if use_deepspeed:
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results[rank] = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, use_deepspeed: bool = False, timeout: float = 900
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, use_deepspeed, fn, args, results))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout}s (a hang in a collective?)")
        out = dict(results)
    errors = [f"rank {r}:\n{v[1]}" for r, v in sorted(out.items()) if v[0] == "error"]
    missing = [r for r in range(world_size) if r not in out]
    if errors or missing:
        raise AssertionError("\n".join(errors) + (f"\nranks with no result: {missing}" if missing else ""))
    return [out[r][1] for r in range(world_size)]
