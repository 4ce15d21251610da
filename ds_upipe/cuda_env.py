"""CUDA + NCCL settings UPipe relies on, checked where the process group is made.

torch 2.6 and 2.7 call ``record_stream`` on every tensor of an NCCL collective that runs on NCCL's
own stream (``all_to_all_single`` included): the caching allocator then keeps each freed stage
buffer reserved until it has seen the collective's event complete, so the pipeline's per-stage
buffers pile up in ``max_memory_reserved`` instead of being reused.  torch 2.8 runs synchronous
collectives on the current stream (no ``record_stream``).  On older torch,
``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` makes ProcessGroupNCCL hold the tensors itself instead; it is
read when the group is created, so it must be set before ``init_process_group``.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import MutableMapping

import torch

AVOID_RECORD_STREAMS = "TORCH_NCCL_AVOID_RECORD_STREAMS"
#: the first torch release whose synchronous NCCL collectives call no record_stream
FIXED_IN = (2, 8)


def _release(torch_version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if match is None:
        raise ValueError(f"cannot read a torch release from {torch_version!r}")
    return int(match.group(1)), int(match.group(2))


def record_streams_problem(torch_version: str, backend: str, env: MutableMapping[str, str]) -> str | None:
    """Why this torch/backend/environment keeps freed stage buffers reserved, or None when it does not."""
    if backend != "nccl" or _release(torch_version) >= FIXED_IN or env.get(AVOID_RECORD_STREAMS) == "1":
        return None
    return (
        f"torch {torch_version} with NCCL calls record_stream on every all_to_all tensor, so UPipe's freed "
        f"stage buffers stay reserved until NCCL's event is seen complete (max_memory_reserved grows with the "
        f"number of stages): use torch >= {FIXED_IN[0]}.{FIXED_IN[1]} or set {AVOID_RECORD_STREAMS}=1 before the "
        "process group is created"
    )


def avoid_record_streams(
    backend: str, torch_version: str = torch.__version__, env: MutableMapping[str, str] | None = None
) -> bool:
    """Before an NCCL group is created on torch < 2.8: set ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` unless
    the user set it (to anything); returns whether it was set here."""
    env = os.environ if env is None else env
    if record_streams_problem(torch_version, backend, env) is None or AVOID_RECORD_STREAMS in env:
        return False
    env[AVOID_RECORD_STREAMS] = "1"
    return True


def warn_if_record_streams(
    backend: str, torch_version: str = torch.__version__, env: MutableMapping[str, str] | None = None
) -> str | None:
    """After the group exists (too late to set the variable): a warning naming the fix, and its text."""
    problem = record_streams_problem(torch_version, backend, os.environ if env is None else env)
    if problem is not None:
        warnings.warn(problem, RuntimeWarning, stacklevel=2)
    return problem
