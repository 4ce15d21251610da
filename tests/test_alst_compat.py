"""DeepSpeed's own ALST tests for HF, unchanged in logic, with and without ``hf_integration.enable()``.

The ``TestUlyssesSPHF*`` classes of DeepSpeed's tests/unit/ulysses_alst/test_ulysses_sp_hf.py (the
0.19 line, commit bf0126b "[SP] add SP deny list instead of allow") call
``UlyssesSPAttentionHF.register_with_transformers`` directly, as plain ALST users do.  Their bodies
run here in three modes:

- ``alst``: DeepSpeed as installed;
- ``enabled``: ``hf_integration.enable()`` active and no accelerate plugin: ALST's registration,
  argument for argument;
- ``upipe``: ``enable()`` active and an accelerate DeepSpeed plugin whose ds_config has
  ``"upipe": {"enabled": true}``: UPipe, honouring the same arguments (model names/paths, model
  objects, PEFT-like wrappers, ``disable_in_eval``, hub kernels, the implementation-mismatch check).

Adapted to CPU only where CUDA or the hub was assumed: gloo, float32 (``preferred_dtype()`` would pick
bf16), device ``cpu`` for ``cuda:{rank}``, and for ``hf-internal-testing/tiny-random-LlamaForCausalLM``
a Llama with the same shape (hidden 16, 4 heads, 2 layers) built from a config and saved with
``save_pretrained`` in a temporary folder, and torch's Adam (``"torch_adam": true``) for DeepSpeed's
FusedAdam, whose CPU build is a C++ compile of about a minute on first use (the bodies never step the
optimizer: their assertions are on losses and gradients).  ``unit.util``'s assertion helpers are reproduced as they
are.  All cases run in one spawn of 2 ranks; each case first resets what DeepSpeed's runner gets
fresh from a new process (the sequence-parallel groups, transformers' attention registry, the
accelerate state).  ``TestUlyssesSPHFFlexAttention`` is skipped (torch's FlexAttention has no
backward on CPU); its body also runs with ``core_attn_implementation="sdpa"`` (a model object passed
only for its config, another model trained).  ds_upipe's own case covers a model object with
``disable_in_eval`` (UPipe patches such a model in place), and the training cases check that UPipe
stages ran in the ``upipe`` mode and in no other.
"""

from __future__ import annotations

import inspect
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import tensor

from ds_upipe.tools.ranks import run_ranks

WORLD = 2
MODES = ("alst", "enabled", "upipe")
#: DeepSpeed's test bodies (pytest ids as in DeepSpeed) and ours
CASES = (
    "TestUlyssesSPHF[zero_stage=2]",
    "TestUlyssesSPHF[zero_stage=3]",
    "TestUlyssesSPHFPEFT",
    "TestUlyssesSPHFDisableInEval",
    "TestUlyssesSPHFHubKernel",
    "TestUlyssesSPHFAttnImplMismatch",
    "TestUlyssesSPHFFlexAttention[zero_stage=2]",
    "TestUlyssesSPHFFlexAttention[zero_stage=3]",
    "TestUlyssesSPHFFlexAttention[zero_stage=2,sdpa]",
    "TestUlyssesSPHFFlexAttention[zero_stage=3,sdpa]",
    "ds_upipe_model_object_disable_in_eval",
)
#: torch's FlexAttention has no backward on CPU ("FlexAttention does not support backward on CPU"), and
#: these ranks are CPU processes over gloo.  The class's body also runs with core_attn_implementation
#: "sdpa" (its registration passes a model object only for its config, then trains another model).
FLEX_ON_CPU = ("TestUlyssesSPHFFlexAttention[zero_stage=2]", "TestUlyssesSPHFFlexAttention[zero_stage=3]")
#: cases whose models run attention in training (UPipe stages must run exactly in the upipe mode)
TRAINS = ("TestUlyssesSPHF[", "TestUlyssesSPHFFlexAttention[", "ds_upipe_model_object")
#: the "upipe" mode's accelerate DeepSpeed plugin config
# ZeRO-2: with stage 3 transformers would build every model of the case under zero.Init
PLUGIN_DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "upipe": {"enabled": True}}


# ---------------------------------------------------------------------------------------------------
# DeepSpeed's unit.common / unit.util helpers, as they are (preferred_dtype: float32 on CPU)


def preferred_dtype() -> torch.dtype:
    return torch.float32


def torch_assert_equal(actual, expected, **kwargs) -> None:  # noqa: ANN001
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=0.0, **kwargs)


def torch_assert_close(actual, expected, **kwargs) -> None:  # noqa: ANN001
    torch.testing.assert_close(actual, expected, **kwargs)


def torch_assert_dicts_of_tensors_equal(actual, expected, **kwargs) -> None:  # noqa: ANN001
    for k in actual.keys():
        torch.testing.assert_close(actual[k], expected[k], rtol=0.0, atol=0.0, **kwargs)


def get_grad(param, zero_stage):  # noqa: ANN001, ANN201
    from deepspeed.utils import safe_get_full_grad

    return safe_get_full_grad(param)


def tiny_llama_config():  # noqa: ANN201
    """The shape of hf-internal-testing/tiny-random-LlamaForCausalLM (vocab cut to 32: ids <= 20)."""
    from ds_upipe.tools.models import tiny_config

    return tiny_config(
        "llama",
        vocab_size=32,
        hidden_size=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )


# ---------------------------------------------------------------------------------------------------
# DeepSpeed's test bodies.  Changes: model_name_or_path is the saved tiny Llama; "cuda:{rank}" -> "cpu";
# self.world_size -> WORLD; pytest's monkeypatch fixture -> pytest.MonkeyPatch.context().


def ulysses_sp_hf(model_name_or_path: str, zero_stage: int) -> None:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups
    from transformers import AutoModelForCausalLM

    core_attn_implementation = "sdpa"
    seq_length = 64
    sequence_parallel_size = WORLD
    micro_batch_size = 1

    rank = dist.get_rank()  # noqa: F841

    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": zero_stage,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "sequence_parallel_size": sequence_parallel_size,
    }

    dtype = preferred_dtype()
    if dtype == torch.bfloat16:
        config_dict["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        config_dict["fp16"] = {"enabled": True, "loss_scale": 1.0}

    # Part 1. Baseline: Setup
    def collate_fn(batch):  # noqa: ANN001, ANN202
        input_ids, position_ids = batch[0]
        return dict(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), labels=input_ids.unsqueeze(0)
        )

    input_ids = tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])
    position_ids = tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    ds = torch.utils.data.TensorDataset(input_ids, position_ids)

    # 1. Baseline: DataLoader calibration
    dl_a = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
    batch_a = next(iter(dl_a))
    expected_batch_a = {
        "input_ids": tensor([[1, 10, 10, 10, 2, 2]]),
        "position_ids": tensor([[0, 1, 2, 3, 4, 5]]),
        "labels": tensor([[1, 10, 10, 10, 2, 2]]),
    }
    torch_assert_dicts_of_tensors_equal(batch_a, expected_batch_a)

    # 2. Baseline: Attention
    model_a = AutoModelForCausalLM.from_pretrained(model_name_or_path)
    model_a, _, _, _ = deepspeed.initialize(
        config=config_dict, model=model_a, model_parameters=model_a.parameters(), mpu=None
    )
    batch_a = move_to_device(batch_a, model_a.device)
    loss_a = model_a(**batch_a).loss
    model_a.backward(loss_a)

    grad_a = get_grad(model_a.module.model.layers[0].self_attn.q_proj.weight, zero_stage)
    assert grad_a is not None

    # Part 2. Ulysses: Setup
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model_name_or_path,
        core_attn_implementation=core_attn_implementation,
        sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        seq_length_is_variable=True,
    )

    model_b = AutoModelForCausalLM.from_pretrained(model_name_or_path, attn_implementation=core_attn_implementation)
    model_b, _, _, _ = deepspeed.initialize(
        config=config_dict, model=model_b, model_parameters=model_b.parameters(), mpu=mpu
    )

    # 3. Ulysses: UlyssesSPDataLoaderAdapter test
    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()
    dl_a = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
    dl_b = UlyssesSPDataLoaderAdapter(
        dl_a, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size, device=model_b.device
    )
    batch_b = next(iter(dl_b))

    expected_batch_b = [
        {
            "input_ids": tensor([[1, 10, 10]]),
            "position_ids": tensor([[0, 1, 2]]),
            "shift_labels": tensor([[10, 10, 10]]),
        },
        {
            "input_ids": tensor([[10, 2, 2]]),
            "position_ids": tensor([[3, 4, 5]]),
            "shift_labels": tensor([[2, 2, -100]]),
        },
    ]

    # here we expect each sample to be sharded in half, rank0 getting the first half and rank1 the other half
    torch_assert_dicts_of_tensors_equal(batch_b, expected_batch_b[sp_rank])

    # 4. UlyssesSPAttentionHF test
    batch_b = move_to_device(batch_b, model_b.device)
    outputs = model_b(**batch_b)
    # HF doesn't calculate loss with shift_labels yet and requires us to do it manually (liger does that)
    shift_labels = batch_b["shift_labels"]
    loss_b = model_b.module.loss_function(
        logits=outputs.logits,
        labels=None,
        shift_labels=shift_labels,
        vocab_size=model_b.module.config.vocab_size,
    )

    # differentiable weighted per-shard-loss aggregation across ranks
    losses_per_rank = torch.distributed.nn.functional.all_gather(loss_b, group=sp_group)
    good_tokens = sum((shift_labels != -100).view(-1))
    good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
    total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(sp_world_size))
    total_good_tokens = sum(good_tokens_per_rank)
    loss_b = total_loss / total_good_tokens
    model_b.backward(loss_b)

    grad_b = get_grad(model_b.module.model.layers[0].self_attn.q_proj.weight, zero_stage)
    assert grad_b is not None

    # compare loss of A (non-Ulysses Attention) and B (Ulyssses Attention)
    torch_assert_equal(loss_a, loss_b)

    # - we are feeding the exact same sample to each rank of A
    # - for B we feed half the sample to each rank, but in total it's the same sample as each rank of A sees
    # thus we expect very similar grads (but not exact)
    if zero_stage in [1, 2]:
        # possibly some issue with z1/z2 as it requires higher tolerance than z3?
        torch_assert_close(grad_a, grad_b, rtol=1.6e-02, atol=1e-03)
    else:
        torch_assert_close(grad_a, grad_b)


def ulysses_sp_hf_with_peft_model(model_name_or_path: str) -> None:
    """register_with_transformers works with PEFT models (config attribute, not a PreTrainedModel)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoConfig

    seq_length = 64
    sequence_parallel_size = WORLD
    micro_batch_size = 1

    # Create a mock PEFT model object that has config but doesn't inherit from PreTrainedModel
    hf_config = AutoConfig.from_pretrained(model_name_or_path)

    class MockPEFTModel:
        """Mock PEFT model that simulates PeftModel behavior"""

        def __init__(self, config) -> None:  # noqa: ANN001
            self.config = config

    mock_peft_model = MockPEFTModel(hf_config)

    # This should not crash and should use the config attribute via duck-typing
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=mock_peft_model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        seq_length_is_variable=True,
    )

    # Verify mpu is created successfully
    assert mpu is not None

    # Verify that the sequence parallel groups are initialized
    sp_group = mpu.get_sequence_parallel_group()
    assert sp_group is not None
    sp_world_size = mpu.get_sequence_parallel_world_size()
    assert sp_world_size == sequence_parallel_size


def disable_in_eval(model_name_or_path: str) -> None:
    """With disable_in_eval=True, eval mode bypasses SP: full sequences give the model's own output."""
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seq_length = 64
    sequence_parallel_size = WORLD
    micro_batch_size = 1

    dtype = preferred_dtype()
    rank = dist.get_rank()  # noqa: F841

    # Full sequence input (not sharded) - this is what users would pass during eval
    input_ids = tensor([[1, 10, 10, 10, 2, 2]], device="cpu")
    position_ids = tensor([[0, 1, 2, 3, 4, 5]], device="cpu")

    # 1. Baseline: model without SP, processing full sequence
    model_baseline = AutoModelForCausalLM.from_pretrained(model_name_or_path, torch_dtype=dtype)
    model_baseline = model_baseline.to("cpu")
    model_baseline.eval()

    # Save original attention function for comparison
    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    with torch.no_grad():
        outputs_baseline = model_baseline(input_ids=input_ids, position_ids=position_ids)
        logits_baseline = outputs_baseline.logits.clone()

    del model_baseline

    # 2. Model with SP registered but disable_in_eval=True
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model_name_or_path,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        seq_length_is_variable=True,
        disable_in_eval=True,
    )

    # Verify that register_with_transformers actually registered the wrapper
    assert mpu is not None, "mpu should not be None when sequence_parallel_size > 1"
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is not original_sdpa, (
        "register_with_transformers should have replaced the attention function"
    )

    model_sp = AutoModelForCausalLM.from_pretrained(model_name_or_path, torch_dtype=dtype)
    model_sp = model_sp.to("cpu")
    model_sp.eval()

    with torch.no_grad():
        outputs_sp = model_sp(input_ids=input_ids, position_ids=position_ids)
        logits_sp = outputs_sp.logits.clone()

    # Verify: with disable_in_eval=True, full sequence input should produce
    # the same output as baseline (SP is bypassed)
    torch_assert_equal(logits_baseline, logits_sp)


def register_hub_kernel_attn(model_name_or_path: str) -> None:
    """Hub-kernel attention strings are registered (lazily, by transformers) before validation.

    Needs no download: transformers' lazy_import_flash_attention is monkeypatched, as in DeepSpeed."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    seq_length = 64
    sequence_parallel_size = WORLD
    micro_batch_size = 1
    hub_attn_implementation = "kernels-community/flash-attn2"

    called_with = []
    had_hub_key_before = hub_attn_implementation in ALL_ATTENTION_FUNCTIONS
    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def _mock_lazy_import_flash_attention(implementation, attention_wrapper=None, allow_all_kernels=False):  # noqa: ANN001, ANN202
        called_with.append(implementation)
        if implementation == hub_attn_implementation and implementation not in ALL_ATTENTION_FUNCTIONS:
            # Mimic transformers hub-kernel registration behavior.
            ALL_ATTENTION_FUNCTIONS.register(implementation, ALL_ATTENTION_FUNCTIONS["sdpa"])
        return (None, None, None, None), None

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(
            "transformers.modeling_flash_attention_utils.lazy_import_flash_attention",
            _mock_lazy_import_flash_attention,
        )

        try:
            mpu = UlyssesSPAttentionHF.register_with_transformers(
                model_name_or_path=model_name_or_path,
                core_attn_implementation=hub_attn_implementation,
                sequence_parallel_size=sequence_parallel_size,
                micro_batch_size=micro_batch_size,
                seq_length=seq_length,
                seq_length_is_variable=True,
            )
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original_sdpa
            assert ALL_ATTENTION_FUNCTIONS[hub_attn_implementation] is not original_sdpa
        finally:
            if not had_hub_key_before and hub_attn_implementation in ALL_ATTENTION_FUNCTIONS:
                ALL_ATTENTION_FUNCTIONS.pop(hub_attn_implementation, None)

    assert mpu is not None
    assert called_with == [hub_attn_implementation]


def register_with_mismatched_attn_impl_raises(model_name_or_path: str) -> None:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoConfig

    seq_length = 64
    sequence_parallel_size = WORLD
    micro_batch_size = 1

    hf_config = AutoConfig.from_pretrained(model_name_or_path)
    hf_config._attn_implementation = "sdpa"

    class MockModel:
        """Mock model wrapper exposing a transformers config attribute."""

        def __init__(self, config) -> None:  # noqa: ANN001
            self.config = config

    with pytest.raises(ValueError, match="does not match model config attn_implementation"):
        UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=MockModel(hf_config),
            core_attn_implementation="flash_attention_2",
            sequence_parallel_size=sequence_parallel_size,
            micro_batch_size=micro_batch_size,
            seq_length=seq_length,
            seq_length_is_variable=True,
        )


def ulysses_sp_hf_flex_attention(zero_stage: int, core_attn_implementation: str = "flex_attention") -> None:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups
    from transformers import AutoModelForCausalLM, LlamaConfig

    # (core_attn_implementation: a parameter here, "flex_attention" in DeepSpeed; see FLEX_ON_CPU)
    # flex_attention's compiled kernel requires head_dim >= 16.
    model_config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=64,
    )  # head_dim = 32/2 = 16
    seq_length = 64
    sequence_parallel_size = WORLD
    micro_batch_size = 1

    rank = dist.get_rank()  # noqa: F841

    config_dict = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": zero_stage,
        },
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "sequence_parallel_size": sequence_parallel_size,
    }

    dtype = preferred_dtype()
    if dtype == torch.bfloat16:
        config_dict["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        config_dict["fp16"] = {"enabled": True, "loss_scale": 1.0}

    # Part 1. Baseline: Setup
    def collate_fn(batch):  # noqa: ANN001, ANN202
        input_ids, position_ids = batch[0]
        return dict(
            input_ids=input_ids.unsqueeze(0), position_ids=position_ids.unsqueeze(0), labels=input_ids.unsqueeze(0)
        )

    input_ids = tensor([[1, 10, 10, 10, 2, 2], [1, 20, 20, 20, 2, 2]])
    position_ids = tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]])
    ds = torch.utils.data.TensorDataset(input_ids, position_ids)

    # 1. Baseline: DataLoader calibration
    dl_a = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
    batch_a = next(iter(dl_a))
    expected_batch_a = {
        "input_ids": tensor([[1, 10, 10, 10, 2, 2]]),
        "position_ids": tensor([[0, 1, 2, 3, 4, 5]]),
        "labels": tensor([[1, 10, 10, 10, 2, 2]]),
    }
    torch_assert_dicts_of_tensors_equal(batch_a, expected_batch_a)

    # 2. Baseline: Attention
    torch.manual_seed(42)
    model_a = AutoModelForCausalLM.from_config(model_config, attn_implementation=core_attn_implementation)
    model_a, _, _, _ = deepspeed.initialize(
        config=config_dict, model=model_a, model_parameters=model_a.parameters(), mpu=None
    )
    batch_a = move_to_device(batch_a, model_a.device)
    loss_a = model_a(**batch_a).loss
    model_a.backward(loss_a)

    grad_a = get_grad(model_a.module.model.layers[0].self_attn.q_proj.weight, zero_stage)
    assert grad_a is not None

    # Part 2. Ulysses: Setup
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model_a.module,
        core_attn_implementation=core_attn_implementation,
        sequence_parallel_size=sequence_parallel_size,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
        seq_length_is_variable=True,
    )

    torch.manual_seed(42)
    model_b = AutoModelForCausalLM.from_config(model_config, attn_implementation=core_attn_implementation)
    model_b, _, _, _ = deepspeed.initialize(
        config=config_dict, model=model_b, model_parameters=model_b.parameters(), mpu=mpu
    )

    # 3. Ulysses: UlyssesSPDataLoaderAdapter test
    sp_group = groups._get_sequence_parallel_group()
    sp_world_size = groups._get_sequence_parallel_world_size()
    sp_rank = groups._get_sequence_parallel_rank()
    dl_a = torch.utils.data.DataLoader(ds, batch_size=micro_batch_size, collate_fn=collate_fn)
    dl_b = UlyssesSPDataLoaderAdapter(
        dl_a, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world_size, device=model_b.device
    )
    batch_b = next(iter(dl_b))

    expected_batch_b = [
        {
            "input_ids": tensor([[1, 10, 10]]),
            "position_ids": tensor([[0, 1, 2]]),
            "shift_labels": tensor([[10, 10, 10]]),
        },
        {
            "input_ids": tensor([[10, 2, 2]]),
            "position_ids": tensor([[3, 4, 5]]),
            "shift_labels": tensor([[2, 2, -100]]),
        },
    ]

    torch_assert_dicts_of_tensors_equal(batch_b, expected_batch_b[sp_rank])

    # 4. UlyssesSPAttentionHF test
    batch_b = move_to_device(batch_b, model_b.device)
    outputs = model_b(**batch_b)
    shift_labels = batch_b["shift_labels"]
    loss_b = model_b.module.loss_function(
        logits=outputs.logits,
        labels=None,
        shift_labels=shift_labels,
        vocab_size=model_b.module.config.vocab_size,
    )

    # differentiable weighted per-shard-loss aggregation across ranks
    losses_per_rank = torch.distributed.nn.functional.all_gather(loss_b, group=sp_group)
    good_tokens = sum((shift_labels != -100).view(-1))
    good_tokens_per_rank = torch.distributed.nn.functional.all_gather(good_tokens, group=sp_group)
    total_loss = sum(losses_per_rank[rank] * good_tokens_per_rank[rank] for rank in range(sp_world_size))
    total_good_tokens = sum(good_tokens_per_rank)
    loss_b = total_loss / total_good_tokens
    model_b.backward(loss_b)

    grad_b = get_grad(model_b.module.model.layers[0].self_attn.q_proj.weight, zero_stage)
    assert grad_b is not None

    # compare loss of A (non-Ulysses Attention) and B (Ulyssses Attention)
    torch_assert_close(loss_a, loss_b, atol=1e-05, rtol=1e-05)

    if zero_stage in [1, 2]:
        torch_assert_close(grad_a, grad_b, rtol=1.6e-02, atol=1e-03)
    else:
        torch_assert_close(grad_a, grad_b)


# ---------------------------------------------------------------------------------------------------
# ds_upipe's own case: a model object with disable_in_eval (UPipe patches it in place)


def model_object_disable_in_eval(model_name_or_path: str) -> None:
    """Registered with the model object and disable_in_eval=True: in training the model runs sequence
    parallel on shards (logits = the baseline's shard), in eval it takes full sequences (= baseline)."""
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers import AutoModelForCausalLM

    input_ids = tensor([[1, 10, 10, 10, 2, 2]])
    position_ids = tensor([[0, 1, 2, 3, 4, 5]])
    baseline = AutoModelForCausalLM.from_pretrained(model_name_or_path, attn_implementation="sdpa")
    with torch.no_grad():
        want = baseline(input_ids=input_ids, position_ids=position_ids).logits

    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, attn_implementation="sdpa")
    UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=WORLD,
        micro_batch_size=1,
        disable_in_eval=True,
    )
    shard = slice(3 * dist.get_rank(), 3 * dist.get_rank() + 3)
    for _ in range(2):  # training, eval, training, eval: the switch works both ways
        model.train()
        with torch.no_grad():
            got = model(input_ids=input_ids[:, shard], position_ids=position_ids[:, shard]).logits
        torch_assert_close(got, want[:, shard], rtol=1e-5, atol=1e-6)
        model.eval()
        with torch.no_grad():
            got = model(input_ids=input_ids, position_ids=position_ids).logits
        torch_assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# rank side: every (mode, case) in one spawn


def _bodies(model_path: str) -> dict[str, Callable[[], None]]:
    return {
        "TestUlyssesSPHF[zero_stage=2]": lambda: ulysses_sp_hf(model_path, 2),
        "TestUlyssesSPHF[zero_stage=3]": lambda: ulysses_sp_hf(model_path, 3),
        "TestUlyssesSPHFPEFT": lambda: ulysses_sp_hf_with_peft_model(model_path),
        "TestUlyssesSPHFDisableInEval": lambda: disable_in_eval(model_path),
        "TestUlyssesSPHFHubKernel": lambda: register_hub_kernel_attn(model_path),
        "TestUlyssesSPHFAttnImplMismatch": lambda: register_with_mismatched_attn_impl_raises(model_path),
        "TestUlyssesSPHFFlexAttention[zero_stage=2]": lambda: ulysses_sp_hf_flex_attention(2),
        "TestUlyssesSPHFFlexAttention[zero_stage=3]": lambda: ulysses_sp_hf_flex_attention(3),
        "TestUlyssesSPHFFlexAttention[zero_stage=2,sdpa]": lambda: ulysses_sp_hf_flex_attention(2, "sdpa"),
        "TestUlyssesSPHFFlexAttention[zero_stage=3,sdpa]": lambda: ulysses_sp_hf_flex_attention(3, "sdpa"),
        "ds_upipe_model_object_disable_in_eval": lambda: model_object_disable_in_eval(model_path),
    }


class _FreshProcessState:
    """What DeepSpeed's runner gets fresh in each test's new processes, snapshot and restored per case."""

    def __init__(self) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        self.registry, self.interface = ALL_ATTENTION_FUNCTIONS, AttentionInterface
        self.local = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
        self.global_ = dict(AttentionInterface._global_mapping)
        self.environ = dict(os.environ)  # Accelerator(deepspeed_plugin=...) sets ACCELERATE_USE_DEEPSPEED

    def restore(self) -> None:
        from accelerate.state import AcceleratorState, PartialState
        from deepspeed.runtime.activation_checkpointing import checkpointing
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from deepspeed.utils import groups

        from ds_upipe import hf_integration

        hf_integration.disable()
        AcceleratorState._reset_state(True)
        PartialState._reset_state()
        os.environ.clear()
        os.environ.update(self.environ)
        self.registry._local_mapping.clear()
        self.registry._local_mapping.update(self.local)
        self.interface._global_mapping.clear()
        self.interface._global_mapping.update(self.global_)
        parallel_state_sp._release_sequence_parallel_groups()
        for owner in (groups, checkpointing):
            if owner.mpu is parallel_state_sp:
                owner.mpu = None


def _enter(mode: str) -> None:
    from ds_upipe import hf_integration

    if mode == "alst":
        return
    hf_integration.enable()
    if mode == "upipe":
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(PLUGIN_DS_CONFIG)))


def alst_cases(rank: int, world: int, model_path: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Run each mode x case; returns {"mode/case": {"error": traceback or None, "stages": UPipe stages run}}."""
    from ds_upipe.pipeline import StageCounter

    fresh = _FreshProcessState()
    bodies = _bodies(model_path)
    results = {}
    for mode in MODES:
        for name in names:
            error = None
            with StageCounter() as stages:
                try:
                    _enter(mode)
                    bodies[name]()
                except BaseException:  # noqa: BLE001 - reported per case to the parent
                    error = traceback.format_exc()
                finally:
                    fresh.restore()
            results[f"{mode}/{name}"] = {"error": error, "stages": stages.count}
            torch.distributed.barrier()
    return results


# ---------------------------------------------------------------------------------------------------
# pytest side


@pytest.fixture(scope="module")
def alst_results(tmp_path_factory) -> list[dict[str, dict[str, Any]]]:
    from transformers import LlamaForCausalLM

    path = Path(tmp_path_factory.mktemp("alst")) / "tiny-random-llama"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(path)
    cases = [c for c in CASES if c not in FLEX_ON_CPU]
    return run_ranks(alst_cases, WORLD, str(path), cases, use_deepspeed=True)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mode", MODES)
def test_deepspeed_alst_hf_tests(alst_results, mode: str, case: str) -> None:
    if case in FLEX_ON_CPU:
        pytest.skip("torch's FlexAttention has no backward on CPU; the same body runs with sdpa ([...,sdpa] cases)")
    for rank, results in enumerate(alst_results):
        result = results[f"{mode}/{case}"]
        assert result["error"] is None, f"rank {rank}, {mode}: {case} failed:\n{result['error']}"
        if case.startswith(TRAINS):  # UPipe ran exactly when the plugin's "upipe" block asked for it
            assert (result["stages"] > 0) == (mode == "upipe"), f"rank {rank}, {mode}/{case}: {result['stages']}"


def test_registration_keeps_alst_signature():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from ds_upipe.integration.hf_integration import UPipeSPAttentionHF

    def params(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(UPipeSPAttentionHF.register_with_transformers) == params(
        UlyssesSPAttentionHF.register_with_transformers
    )
