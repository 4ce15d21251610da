"""GPU setup rules checked without a GPU: the torch/NCCL record_stream check and the data loader's
collective device (a CPU tensor cannot be all_gathered on an NCCL-only group)."""

import pytest
import torch

from hf_patches.data import collective_device


def test_nccl_record_streams_check_by_torch_version():
    """torch < 2.8 with NCCL keeps freed stage buffers reserved (record_stream): the variable is set
    before the group is made unless the user set it, and a warning names the fix once it is too late;
    gloo, torch >= 2.8 and TORCH_NCCL_AVOID_RECORD_STREAMS=1 pass."""
    import warnings

    from ds_upipe.cuda_env import (
        AVOID_RECORD_STREAMS,
        avoid_record_streams,
        record_streams_problem,
        warn_if_record_streams,
    )

    for version in ("2.6.0+cu124", "2.7.1"):
        assert "use torch >= 2.8 or set TORCH_NCCL_AVOID_RECORD_STREAMS=1" in record_streams_problem(
            version, "nccl", {}
        )
        env: dict[str, str] = {}
        assert avoid_record_streams("nccl", version, env) and env == {AVOID_RECORD_STREAMS: "1"}
        assert record_streams_problem(version, "nccl", env) is None
        user = {AVOID_RECORD_STREAMS: "0"}  # the user's choice is kept, and warned about
        assert not avoid_record_streams("nccl", version, user) and user[AVOID_RECORD_STREAMS] == "0"
        with pytest.warns(RuntimeWarning, match="record_stream on every all_to_all tensor"):
            warn_if_record_streams("nccl", version, user)
    for version, backend in (("2.8.0", "nccl"), ("2.11.0+cu130", "nccl"), ("2.6.0", "gloo")):
        env = {}
        assert record_streams_problem(version, backend, env) is None and not avoid_record_streams(backend, version, env)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert warn_if_record_streams(backend, version, env) is None


def test_loader_device_is_the_groups_own():
    """The default (None) is the group's device: the CPU on gloo or a gloo+NCCL group, CUDA on an
    NCCL-only one (the old default "cpu" made DeepSpeed's adapter all_gather CPU tensors over NCCL,
    which fails); a device the backend cannot gather on is refused naming both."""
    assert collective_device("gloo") == torch.device("cpu")
    assert collective_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert collective_device("cpu:gloo,cuda:nccl", "cuda:1") == torch.device("cuda", 1)
    assert collective_device("nccl", "cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="backend 'nccl' cannot all_gather cpu tensors"):
        collective_device("nccl", "cpu")
    with pytest.raises(ValueError, match="backend 'gloo' cannot all_gather cuda tensors"):
        collective_device("gloo", "cuda")
    if torch.cuda.is_available():
        assert collective_device("nccl").type == "cuda"
