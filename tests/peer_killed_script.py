"""Launched by tests/test_clean_exit.py under the ``deepspeed`` launcher: a real ``ds_upipe.initialize``
on 2 ranks, then rank 1 dies by SIGKILL (no exit path of its own) while rank 0 waits in a collective.
The launcher then stops rank 0 with SIGTERM; rank 0's exit path must remove both ranks' shm segments."""

import os
import signal
import time

import torch

import ds_upipe
from tests.engine_cases import BASE, tiny_llama

model = tiny_llama()
engine, *_ = ds_upipe.initialize(model=model, model_parameters=model.parameters(), config=BASE)
if engine.global_rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1)
torch.distributed.all_reduce(torch.ones(1))  # the peer is gone: gloo fails or the launcher's SIGTERM comes
time.sleep(60)
