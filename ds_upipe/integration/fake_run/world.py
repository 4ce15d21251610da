"""The fake process world: this process as rank 0 of a ``fake`` group of C ranks (collectives keep shapes,
move nothing), deepspeed.comm over it, and the real backend's buffer retention."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

# -- the fake world ----------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[dist.ProcessGroup]:
    """This process as rank 0 of a ``fake`` process group of ``world_size`` ranks, for the duration."""
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world needs a process without a default process group; use fake_run.isolated(...) instead"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        _release_deepspeed_sp_groups()
        dist.destroy_process_group()
        _forget_deepspeed_comm()


def _deepspeed_comm_on_fake_world() -> None:
    """deepspeed.comm over the fake group (ALST's parallel_state_sp and all-to-alls go through it)."""
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        with contextlib.redirect_stdout(sys.stderr):  # its shm-op build message would pollute stdout
            deepspeed.comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False, verbose=False)


def _forget_deepspeed_comm() -> None:
    """Drop deepspeed.comm's backend object of the fake group (destroyed with it)."""
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None


def _release_deepspeed_sp_groups() -> None:
    """DeepSpeed's parallel_state_sp groups that ALST's registration made inside the fake world."""
    mpu = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if mpu is not None and mpu._SEQUENCE_PARALLEL_GROUP is not None:
        mpu._release_sequence_parallel_groups()


class _HeldWork:
    """An async collective's Work that keeps its tensors until it is dropped, as gloo's does."""

    def __init__(self, work: Any, tensors: tuple[torch.Tensor, ...]) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)


@contextlib.contextmanager
def _backend_retention(backend: str) -> Iterator[None]:
    """What the real backend keeps alive that the fake group does not: gloo's async Work holds its
    send and receive buffers until the handle dies (measured on CPU); NCCL releases them at wait(),
    as the fake group's Work does."""
    if backend != "gloo":
        yield
        return
    original = dist.all_to_all_single

    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = original(output, input, *args, **kwargs)
        return _HeldWork(work, (output, input)) if kwargs.get("async_op") else work

    dist.all_to_all_single = all_to_all_single
    try:
        yield
    finally:
        dist.all_to_all_single = original
