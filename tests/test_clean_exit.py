"""A successful launch exits 0 and leaves nothing behind, also when the next launch reuses its port.

DeepSpeed's CPU shm-allreduce segments (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>,
66 MB each) used to outlive every ``deepspeed`` launch; a later launch on the same port then mapped
a stale peer's segment.  ``tests/engine_cases.launch`` asserts after every launch that none is left;
this test launches twice on one port (UPipe, then ALST) and checks both exit 0.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ds_upipe.tools.ranks import free_port
from tests.engine_cases import DEEPSPEED, REPO, launch, run, shm_segments


@pytest.mark.slow
def test_repeated_launch_on_one_port_exits_cleanly(tmp_path):
    port = free_port()
    for name, config in (("upipe", "upipe_zero3"), ("alst", "ulysses_alst_zero3")):
        rc, output, metrics = launch(2, [run(name, config, sp=2)], tmp_path / name, steps=1, seq_len=32, port=port)
        assert rc == 0, output[-4000:]
        assert len(metrics["by_name"][name]["losses"]) == 1, metrics


@pytest.mark.slow
def test_killed_peer_leaves_no_shm_segment(tmp_path):
    """Rank 1 is killed (SIGKILL) after initialize; the launcher stops rank 0 (SIGTERM), whose exit
    path removes both ranks' segments (the killed rank's used to stay, 66 MB each)."""
    port = free_port()
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(port), "tests/peer_killed_script.py"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert time.monotonic() - start < 240
    assert not shm_segments(port), (shm_segments(port), proc.stdout[-3000:], proc.stderr[-3000:])
