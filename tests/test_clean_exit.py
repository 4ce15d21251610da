"""A successful launch exits 0 and leaves nothing behind, also when the next launch reuses its port.

DeepSpeed's CPU shm-allreduce segments (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>,
66 MB each) used to outlive every ``deepspeed`` launch; a later launch on the same port then mapped
a stale peer's segment.  ``tests/engine_cases.launch`` asserts after every launch that none is left;
this test launches twice on one port (UPipe, then ALST) and checks both exit 0.
"""

from __future__ import annotations

import pytest

from ds_upipe.tools.ranks import free_port
from tests.engine_cases import launch, run


@pytest.mark.slow
def test_repeated_launch_on_one_port_exits_cleanly(tmp_path):
    port = free_port()
    for name, config in (("upipe", "upipe_zero3"), ("alst", "ulysses_alst_zero3")):
        rc, output, metrics = launch(2, [run(name, config, sp=2)], tmp_path / name, steps=1, seq_len=32, port=port)
        assert rc == 0, output[-4000:]
        assert len(metrics["by_name"][name]["losses"]) == 1, metrics
