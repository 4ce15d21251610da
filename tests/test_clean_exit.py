"""A launch whose rank is killed leaves no shm segment behind.

DeepSpeed's CPU shm-allreduce segments (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>,
66 MB each) used to outlive every ``deepspeed`` launch; a later launch on the same port then mapped
a stale peer's segment.  ``tests/engine_cases.launch`` asserts after every launch that none is left,
and tests/test_engine_launch.py runs its two launches on one port (both end through their own exit
path); here a rank is killed and the survivor's exit path must remove both ranks' segments.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from ds_upipe.tools.ranks import free_port
from tests.engine_cases import DEEPSPEED, REPO, shm_segments


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
