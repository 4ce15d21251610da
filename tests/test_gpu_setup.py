"""GPU setup rules checked without a GPU: the torch/NCCL record_stream check and the data loader's
collective device (a CPU tensor cannot be all_gathered on an NCCL-only group)."""

import os
import subprocess
import sys
from pathlib import Path

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


def test_gpu_wheels_uses_the_venv_of_its_own_clone(tmp_path):
    """scripts/gpu_wheels.sh, run from a clone in another folder (and from another working directory),
    takes that clone's .venv: no path of the machine it was written on (it once defaulted to one)."""
    root = Path(__file__).resolve().parents[1]
    clone = tmp_path / "elsewhere" / "clone"
    subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)
    (clone / ".venv/bin").mkdir(parents=True)
    (clone / ".venv/bin/python").symlink_to(sys.executable)  # the clone's venv: this test's interpreter
    env = {k: v for k, v in os.environ.items() if k != "PY"}
    run = subprocess.run(
        ["bash", str(clone / "scripts/gpu_wheels.sh")],
        cwd=tmp_path,
        env={**env, "GPU_WHEELS_PLAN": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == f"python: {clone}/.venv/bin/python", run.stdout
    assert "deepspeed==" in run.stdout
    # a clone without a venv: the script says what to do instead of "No such file or directory"
    (clone / ".venv/bin/python").unlink()
    run = subprocess.run(["bash", str(clone / "scripts/gpu_wheels.sh")], env=env, capture_output=True, text=True)
    assert run.returncode == 1 and "run scripts/setup_env.sh in this clone first" in run.stderr, run.stderr
