"""The ``"upipe"`` block of a ds_config, validated, plus the checks that need the world size or the model.

A ds_config turns UPipe on with DeepSpeed's own ``sequence_parallel_size`` and one block of ours::

    {"sequence_parallel_size": 4,
     "upipe": {"enabled": true, "head_chunk_size": "auto", "memory_budget_gib": 8, "seq_length": 131072}}

Everything here is pure (no process groups, no transformers), so a bad config fails the same way on
every rank before any collective runs.  Key-by-key documentation: docs/config.md.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, ValidationError, model_validator

from ..schedule import (
    check_head_counts,
    resolve_head_chunk_size,
    valid_group_sizes,
    valid_head_chunk_sizes,
)

#: what each key accepts, quoted in error messages (and in docs/config.md)
ALLOWED: dict[str, str] = {
    "enabled": "true or false",
    "head_chunk_size": (
        'null (= sequence_parallel_size, least memory), "auto", or an int that is a multiple of '
        "sequence_parallel_size and divides the model's num_attention_heads"
    ),
    "fused_projections": "true or false",
    "kernel": '"sdpa", "math" or "flash_attn"',
    "memory_budget_gib": "null or a number > 0 (GiB per rank for one layer's attention stage buffers)",
    "seq_length": "null or an int > 0 (the global sequence length, in tokens)",
    "offload_checkpoints": "true or false",
    "overlap_comm": "true or false",
}


class UPipeConfig(BaseModel):
    """The ``"upipe"`` block.  Strict types: ``"true"`` is not a bool, ``2.0`` is not an int."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: StrictBool = True
    head_chunk_size: StrictInt | Literal["auto"] | None = None
    fused_projections: StrictBool = True
    kernel: Literal["sdpa", "math", "flash_attn"] = "sdpa"
    memory_budget_gib: StrictFloat | StrictInt | None = None
    seq_length: StrictInt | None = None
    offload_checkpoints: StrictBool = False
    overlap_comm: StrictBool = False

    @model_validator(mode="after")
    def _check_values(self) -> UPipeConfig:
        problems = []
        if isinstance(self.head_chunk_size, int) and self.head_chunk_size < 1:
            problems.append("head_chunk_size")
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            problems.append("memory_budget_gib")
        if self.seq_length is not None and self.seq_length < 1:
            problems.append("seq_length")
        if problems:
            raise ValueError("|".join(problems))
        if self.head_chunk_size == "auto" and (self.memory_budget_gib is None or self.seq_length is None):
            raise ValueError(
                'upipe.head_chunk_size="auto" needs upipe.memory_budget_gib (GiB per rank) and upipe.seq_length '
                "(global tokens per sequence) to predict attention memory; set both, or give head_chunk_size as an int"
            )
        return self


def _format_validation_error(err: ValidationError, block: dict[str, Any]) -> str:
    lines: dict[str, str] = {}
    for e in err.errors():
        loc = e["loc"]
        if e["type"] == "extra_forbidden":
            key = str(loc[0])
            lines[key] = f"upipe.{key}: unknown key; allowed keys: {', '.join(UPipeConfig.model_fields)}"
        elif loc:
            key = str(loc[0])
            lines.setdefault(key, f"upipe.{key}: got {block.get(key)!r}; allowed: {ALLOWED[key]}")
        else:  # model-level: either our list of out-of-range keys or a whole message
            msg = str(e.get("ctx", {}).get("error", e["msg"]))
            keys = msg.split("|")
            if all(k in ALLOWED for k in keys):
                for key in keys:
                    lines[key] = f"upipe.{key}: got {block.get(key)!r}; allowed: {ALLOWED[key]}"
            else:
                lines["_"] = msg
    return "invalid ds_config: " + "; ".join(lines.values())


def parse_upipe_block(block: Any) -> UPipeConfig:
    """Validate the ``"upipe"`` block (None or absent means all defaults); ValueError names each bad key."""
    if block is None:
        return UPipeConfig()
    if not isinstance(block, dict):
        raise ValueError(f'invalid ds_config: "upipe" must be a JSON object, got {type(block).__name__}')
    try:
        return UPipeConfig(**block)
    except ValidationError as err:
        raise ValueError(_format_validation_error(err, block)) from None


@dataclass(frozen=True)
class SPSettings:
    """What ds_upipe reads from a ds_config (the rest is DeepSpeed's)."""

    sequence_parallel_size: int
    upipe: UPipeConfig
    zero_stage: int
    dtype_bytes: int  # of activations: 2 with bf16/fp16 enabled, else 4


def load_config(config: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    """A ds_config from a path or a dict (deep-copied, so callers' dicts are never modified)."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, str | os.PathLike):
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    raise ValueError(f"config must be a path or a dict, got {type(config).__name__}")


def parse_config(ds_config: dict[str, Any]) -> SPSettings:
    """Validate our part of a ds_config; every rule here depends on the config alone."""
    sp = ds_config.get("sequence_parallel_size", 1)
    if isinstance(sp, bool) or not isinstance(sp, int) or sp < 1:
        raise ValueError(f"invalid ds_config: sequence_parallel_size: got {sp!r}; allowed: an int >= 1")
    upipe = parse_upipe_block(ds_config.get("upipe"))
    zero = ds_config.get("zero_optimization", {}) or {}
    zero_stage = zero.get("stage", 0)
    if sp > 1 and zero_stage == 0:
        # Without ZeRO, DeepSpeed's engine averages gradients over world/sp ranks (engine.py,
        # _reduce_non_expert_gradients), the sp-times scale of DeepSpeed issue #5248; ZeRO 1-3 are
        # corrected in ds_upipe.integration.engine, stage 0 is not wired.
        raise ValueError(
            f"invalid ds_config: zero_optimization.stage: got {zero_stage!r} with sequence_parallel_size={sp}; "
            "allowed: 1, 2 or 3 (sequence parallelism needs ZeRO)"
        )
    act = ds_config.get("activation_checkpointing", {}) or {}
    if sp > 1 and act.get("partition_activations", False):
        # DeepSpeed would split each checkpointed activation across the "model-parallel" group, which
        # with the sequence-parallel mpu is the sequence group: its ranks hold different tokens, not replicas.
        raise ValueError(
            "invalid ds_config: activation_checkpointing.partition_activations: got true with "
            f"sequence_parallel_size={sp}; allowed: false (sequence-parallel ranks hold different tokens, so "
            "activations cannot be partitioned across them; use cpu_checkpointing or upipe.offload_checkpoints "
            "to move checkpoints off the device instead)"
        )
    half = any((ds_config.get(k, {}) or {}).get("enabled", False) for k in ("bf16", "fp16", "bfloat16"))
    return SPSettings(sequence_parallel_size=sp, upipe=upipe, zero_stage=zero_stage, dtype_bytes=2 if half else 4)


def check_world(sequence_parallel_size: int, world_size: int) -> int:
    """The data-parallel size world/sp; ValueError unless sp divides the world."""
    if world_size % sequence_parallel_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"invalid ds_config: sequence_parallel_size: got {sequence_parallel_size} for a world of {world_size} "
            f"processes; allowed: a divisor of the world size {divisors}"
        )
    return world_size // sequence_parallel_size


def check_heads(num_heads: int, num_kv_heads: int, sequence_parallel_size: int) -> None:
    """ValueError unless the model's heads can be split over the sequence-parallel group."""
    try:
        check_head_counts(num_heads, num_kv_heads, sequence_parallel_size)
    except ValueError as err:
        valid = valid_group_sizes(num_heads, num_kv_heads)
        raise ValueError(
            f"invalid ds_config: sequence_parallel_size: got {sequence_parallel_size} for a model with "
            f"num_attention_heads={num_heads}, num_key_value_heads={num_kv_heads}: {err}. "
            f"Allowed sequence_parallel_size for this model: {valid}"
        ) from None


def attention_stage_bytes(
    head_chunk_size: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    seq_length: int,
    micro_batch_size: int,
    dtype_bytes: int,
) -> int:
    """Per-rank attention stage memory of UPipe at this head chunk size, in bytes: the intermediate
    peak (peak minus q, k, v, out, dout, dq, dk, dv) of ``UPipeDistributedAttention`` forward+backward,
    measured by running it on fake tensors as rank 0 of the group (``fake_run.core_step``, the same
    fake-tensor execution ``ds-upipe plan`` uses; in a process that already has a process group it
    runs in a child process).  Kernel-internal CUDA workspaces are not included."""
    from . import fake_run

    dtype = {2: "bf16", 4: "fp32", 8: "fp64"}[dtype_bytes]
    seq = seq_length - seq_length % group_size or group_size
    peak = fake_run.isolated(
        "core_step",
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        group_size=group_size,
        head_chunk_size=head_chunk_size,
        seq_len=seq,
        batch=micro_batch_size,
        dtype=dtype,
    )
    return int(peak["total"] - peak["weights"])


def choose_head_chunk_size(
    upipe: UPipeConfig,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    group_size: int,
    micro_batch_size: int,
    dtype_bytes: int,
) -> int:
    """The head chunk size U to use: the configured int (validated), C for null, and for "auto" the
    largest valid U whose predicted stage memory fits ``memory_budget_gib`` (C when none fits)."""
    value = upipe.head_chunk_size
    if value != "auto":
        try:
            return resolve_head_chunk_size(num_heads, num_kv_heads, group_size, value)
        except ValueError as err:
            raise ValueError(f"invalid ds_config: upipe.head_chunk_size: {err}") from None
    budget = upipe.memory_budget_gib * 2**30
    fits = [
        u
        for u in valid_head_chunk_sizes(num_heads, num_kv_heads, group_size)
        if attention_stage_bytes(
            u,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            group_size=group_size,
            seq_length=upipe.seq_length,
            micro_batch_size=micro_batch_size,
            dtype_bytes=dtype_bytes,
        )
        <= budget
    ]
    return max(fits) if fits else group_size


def micro_batch_size(ds_config: dict[str, Any], data_parallel_size: int) -> int:
    """train_micro_batch_size_per_gpu, derived as DeepSpeed does when only the other two are given."""
    mb = ds_config.get("train_micro_batch_size_per_gpu")
    if mb is not None:
        return int(mb)
    train = ds_config.get("train_batch_size")
    gas = ds_config.get("gradient_accumulation_steps", 1)
    if train is None:
        return 1
    return int(train) // (int(gas) * data_parallel_size)
