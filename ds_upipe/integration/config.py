"""The ``"upipe"`` block of a ds_config, validated, plus the checks that need the world size or the model.

A ds_config turns UPipe on with DeepSpeed's own ``sequence_parallel_size`` and one block of ours::

    {"sequence_parallel_size": 4,
     "upipe": {"enabled": true, "head_chunk_size": "auto", "memory_budget_gib": 8, "seq_length": 131072}}

``"ring_size": R`` makes it UPipe x Ring: C_u = sequence_parallel_size / R ranks run UPipe's
all-to-alls (within a node), R ranks ring attention (across nodes).

Everything here is pure (no process groups, no transformers, no measurement: "auto" is measured in
``auto_chunk``), so a bad config fails the same way on every rank before any collective runs.
Key-by-key documentation: docs/config.md.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, model_validator

from ..heads import head_counts, per_head_counts
from ..options import KERNEL_NAMES, UPipeOptions
from ..schedule import (
    check_head_counts,
    valid_group_sizes,
)

logger = logging.getLogger("ds_upipe")

#: what the long-context stack's keys accept
TILED = 'true, false, or {"tile_tokens": null or an int > 0} (on, with that many tokens per tile)'
#: what each key accepts, quoted in error messages (and in docs/config.md)
ALLOWED: dict[str, str] = {
    "enabled": "true or false",
    "head_chunk_size": (
        'null (= sequence_parallel_size, least memory), "auto", or an int that is a multiple of '
        "sequence_parallel_size and divides the model's num_attention_heads"
    ),
    "mixer_head_chunk_size": (
        'null (= sequence_parallel_size), "auto", or an int that is a multiple of sequence_parallel_size and '
        "divides the heads of the model's linear-attention / state-space mixers"
    ),
    "fused_projections": "true or false",
    "kernel": '"sdpa", "math", "flash_attn" or "fa3"',
    "memory_budget_gib": "null or a number > 0 (GiB per rank for the intermediate peak of one layer's attention)",
    "seq_length": "null or an int > 0 (the global sequence length, in tokens)",
    "offload_checkpoints": "true or false",
    "overlap_comm": "true or false",
    "ring_size": "an int >= 1 that divides sequence_parallel_size (1: no ring)",
    "accumulate_dtype": '"fp32" or "input" (the dtype bf16/fp16 gradients are summed in over the stages)',
    "recompute_attention_output": "true or false (fused projections only)",
    "share_exchanged_kv": "true or false (KV-shared layers: Gemma 3n, Gemma 4)",
    "checkpoint_pairs": "an int >= 0, at most half the model's decoder layers (needs activation checkpointing)",
    "checkpoint_groups": (
        "an int >= 0, at most the model's decoder layers / checkpoint_group_size (needs activation checkpointing)"
    ),
    "checkpoint_group_size": "an int >= 2 (the layers of one checkpoint group)",
    "tiled_loss": TILED,
    "tiled_norm": TILED,
    "tiled_mlp": TILED,
}


class Tiled(BaseModel):
    """A long-context stack part given as an object: on, with ``tile_tokens`` tokens per tile
    (null: hf_patches.apply_long_context_stack's default for that part)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tile_tokens: Annotated[StrictInt, Field(gt=0)] | None = None


#: ``true``/``false`` or ``{"tile_tokens": ...}``
TiledSetting = StrictBool | Tiled


def tiled(value: TiledSetting) -> tuple[bool, int | None]:
    """(on, tokens per tile or None for the default) of a ``tiled_*`` key."""
    if isinstance(value, Tiled):
        return True, value.tile_tokens
    return bool(value), None


class UPipeConfig(BaseModel):
    """The ``"upipe"`` block.  Strict types: ``"true"`` is not a bool, ``2.0`` is not an int."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: StrictBool = True
    head_chunk_size: StrictInt | Literal["auto"] | None = None
    #: U of the model's other sequence mixers (hf_patches.mixers), in their heads
    mixer_head_chunk_size: StrictInt | Literal["auto"] | None = None
    fused_projections: StrictBool = True
    kernel: Literal[KERNEL_NAMES] = "sdpa"
    memory_budget_gib: StrictFloat | StrictInt | None = None
    seq_length: StrictInt | None = None
    offload_checkpoints: StrictBool = False
    overlap_comm: StrictBool = False
    ring_size: StrictInt = 1
    accumulate_dtype: Literal["fp32", "input"] = "fp32"
    #: fused mode: backward recomputes each stage's attention instead of keeping the layer's attention output
    recompute_attention_output: StrictBool = False
    #: KV-shared layers attend with their producing layer's exchanged K/V, held from its forward to its backward
    share_exchanged_kv: StrictBool = True
    #: the lowest N x k decoder layers checkpointed in groups of k on one saved input
    #: (integration.checkpoint_groups); ``checkpoint_pairs: N`` is N groups of 2 (``checkpoint_grouping``)
    checkpoint_groups: StrictInt = 0
    checkpoint_group_size: StrictInt = 2
    checkpoint_pairs: StrictInt = 0
    # the long-context stack (hf_patches.apply_long_context_stack); also with enabled=false (ALST)
    tiled_loss: TiledSetting = False
    tiled_norm: TiledSetting = False
    tiled_mlp: TiledSetting = False

    def options(self, head_chunk_size: int | None, mixer_head_chunk_size: int | None = None) -> UPipeOptions:
        """The run's ``UPipeOptions``: the one translation of the block's keys (``head_chunk_size``: U as
        resolved for the model, ``auto_chunk.choose_head_chunk_size``; "auto" is not a U).  The mixers' U is
        the block's, or where it says "auto" ``mixer_head_chunk_size`` as resolved for the model
        (``auto_chunk.run_mixer_head_chunk_size``; None where only attention is built from these options)."""
        mixer = self.mixer_head_chunk_size
        return UPipeOptions(
            head_chunk_size=head_chunk_size,
            mixer_head_chunk_size=mixer_head_chunk_size if mixer == "auto" else mixer,
            kernel=self.kernel,
            fused_projections=self.fused_projections,
            overlap_comm=self.overlap_comm,
            accumulate_in_input_dtype=self.accumulate_dtype == "input",
            recompute_attention_output=self.recompute_attention_output,
            share_exchanged_kv=self.share_exchanged_kv,
        )

    @property
    def checkpoint_grouping(self) -> tuple[int, int]:
        """(groups, layers per group): the one reading of ``checkpoint_groups``, ``checkpoint_group_size`` and
        ``checkpoint_pairs`` (N pairs = N groups of 2; setting both is refused by the validator)."""
        if self.checkpoint_pairs:
            return self.checkpoint_pairs, 2
        return self.checkpoint_groups, self.checkpoint_group_size

    @property
    def long_context(self) -> bool:
        """Whether any part of the long-context stack is on."""
        return any(tiled(v)[0] for v in (self.tiled_loss, self.tiled_norm, self.tiled_mlp))

    @model_validator(mode="after")
    def _check_values(self) -> UPipeConfig:
        problems = []
        if isinstance(self.head_chunk_size, int) and self.head_chunk_size < 1:
            problems.append("head_chunk_size")
        if isinstance(self.mixer_head_chunk_size, int) and self.mixer_head_chunk_size < 1:
            problems.append("mixer_head_chunk_size")
        if self.memory_budget_gib is not None and not self.memory_budget_gib > 0:
            problems.append("memory_budget_gib")
        if self.seq_length is not None and self.seq_length < 1:
            problems.append("seq_length")
        if self.ring_size < 1:
            problems.append("ring_size")
        if self.checkpoint_pairs < 0:
            problems.append("checkpoint_pairs")
        if self.checkpoint_groups < 0:
            problems.append("checkpoint_groups")
        if self.checkpoint_group_size < 2:
            problems.append("checkpoint_group_size")
        if problems:
            raise ValueError("|".join(problems))
        if self.checkpoint_pairs and (self.checkpoint_groups or self.checkpoint_group_size != 2):
            raise ValueError(
                f"upipe.checkpoint_pairs={self.checkpoint_pairs} with upipe.checkpoint_groups={self.checkpoint_groups}"
                f", checkpoint_group_size={self.checkpoint_group_size}: checkpoint_pairs N is checkpoint_groups N of "
                "size 2; set one of them (checkpoint_groups and checkpoint_group_size for groups of another size)"
            )
        for key in ("head_chunk_size", "mixer_head_chunk_size"):
            if getattr(self, key) == "auto" and (self.memory_budget_gib is None or self.seq_length is None):
                raise ValueError(
                    f'upipe.{key}="auto" needs upipe.memory_budget_gib (GiB per rank) and upipe.seq_length '
                    f"(global tokens per sequence) to predict its stage memory; set both, or give {key} as an int"
                )
        return self


def _format_validation_error(err: ValidationError, block: dict[str, Any]) -> str:
    lines: dict[str, str] = {}
    for e in err.errors():
        loc = e["loc"]
        if e["type"] == "extra_forbidden" and len(loc) == 1:  # an unknown key of the block itself
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
    """What ds_upipe reads from a ds_config (the rest is DeepSpeed's): the one reader of a ds_config,
    shared by the runtime (``ds_upipe.initialize``, the HF integration) and ``ds-upipe plan``."""

    sequence_parallel_size: int
    upipe: UPipeConfig
    zero_stage: int
    dtype_bytes: int  # of activations: 2 with bf16/fp16 enabled, else 4
    #: "bf16", "fp16" or "fp32": the activations' dtype
    dtype: str = "fp32"
    #: the model's layers are checkpointed (``checkpoints_layers``)
    checkpointing: bool = False
    #: checkpointed layer inputs kept in host memory (``activation_checkpointing.cpu_checkpointing`` or
    #: ``upipe.offload_checkpoints``; only where layers are checkpointed)
    offload_checkpoints: bool = False
    #: ``train_micro_batch_size_per_gpu`` as given (None: derived, ``micro_batch_size``)
    micro_batch_size: int | None = None
    #: ``zero_optimization`` as given (DeepSpeed validates it; the planner reads its offload settings)
    zero_optimization: dict[str, Any] = field(default_factory=dict)

    @property
    def ring_size(self) -> int:
        return self.upipe.ring_size

    @property
    def ulysses_size(self) -> int:
        """C_u: the ranks UPipe's all-to-alls (and the heads) are split over."""
        return self.sequence_parallel_size // self.upipe.ring_size


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
    check_ring_size(upipe, sp)
    check_recompute_attention_output(upipe)
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
    check_checkpoint_groups(upipe, checkpoints_layers(ds_config, upipe), act)
    if sp > 1 and act.get("partition_activations", False):
        # DeepSpeed would split each checkpointed activation across the "model-parallel" group, which
        # with the sequence-parallel mpu is the sequence group: its ranks hold different tokens, not replicas.
        raise ValueError(
            "invalid ds_config: activation_checkpointing.partition_activations: got true with "
            f"sequence_parallel_size={sp}; allowed: false (sequence-parallel ranks hold different tokens, so "
            "activations cannot be partitioned across them; use cpu_checkpointing or upipe.offload_checkpoints "
            "to move checkpoints off the device instead)"
        )
    enabled = {k: bool((ds_config.get(k, {}) or {}).get("enabled", False)) for k in ("bf16", "bfloat16", "fp16")}
    dtype = "bf16" if enabled["bf16"] or enabled["bfloat16"] else "fp16" if enabled["fp16"] else "fp32"
    checkpointing = checkpoints_layers(ds_config, upipe)
    mb = ds_config.get("train_micro_batch_size_per_gpu")
    return SPSettings(
        sequence_parallel_size=sp,
        upipe=upipe,
        zero_stage=zero_stage,
        dtype_bytes=4 if dtype == "fp32" else 2,
        dtype=dtype,
        checkpointing=checkpointing,
        offload_checkpoints=checkpointing and (bool(act.get("cpu_checkpointing", False)) or upipe.offload_checkpoints),
        micro_batch_size=None if mb is None else int(mb),
        zero_optimization=dict(zero),
    )


def checkpoints_layers(ds_config: dict[str, Any], upipe: UPipeConfig) -> bool:
    """Whether ds_upipe checkpoints the model's layers: an ``activation_checkpointing`` section or
    ``upipe.offload_checkpoints`` (sp_setup.configure_activation_checkpointing; the planner)."""
    return ds_config.get("activation_checkpointing") is not None or upipe.offload_checkpoints


def check_checkpoint_groups(upipe: UPipeConfig, checkpointing: bool, act: dict[str, Any]) -> None:
    """ValueError if checkpoint groups (``upipe.checkpoint_groups`` / ``checkpoint_pairs``) are set where no
    layer is checkpointed, or beside DeepSpeed's activation partitioning (a group keeps its own copy of its
    input, unpartitioned)."""
    groups, _ = upipe.checkpoint_grouping
    if not groups:
        return
    key = "checkpoint_pairs" if upipe.checkpoint_pairs else "checkpoint_groups"
    if not checkpointing:
        raise ValueError(
            f"invalid ds_config: upipe.{key}: got {groups} without activation checkpointing; allowed: 0, "
            'or add an "activation_checkpointing" section (or upipe.offload_checkpoints: true): groups are a way '
            "to checkpoint layers"
        )
    if act.get("partition_activations", False):
        raise ValueError(
            f"invalid ds_config: upipe.{key}: got {groups} with activation_checkpointing."
            "partition_activations=true; allowed: 0 there (a group keeps its saved input whole); set "
            f"partition_activations to false or upipe.{key} to 0"
        )


def check_recompute_attention_output(upipe: UPipeConfig) -> None:
    """ValueError if ``upipe.recompute_attention_output`` is on where it cannot act: only fused UPipe
    owns o_proj's weight gradient (the rule on the settings: ``UPipeOptions``; in ALST the model's o_proj
    keeps the output itself)."""
    if not upipe.recompute_attention_output:
        return
    if not upipe.enabled:
        raise ValueError(
            "invalid ds_config: upipe.recompute_attention_output: got true with upipe.enabled=false; allowed: false "
            "(DeepSpeed ALST keeps the attention output for o_proj; set upipe.enabled=true for UPipe)"
        )
    try:
        upipe.options(None)
    except ValueError as err:
        raise ValueError(f"invalid ds_config: upipe.recompute_attention_output: got true: {err}") from None


def check_ring_size(upipe: UPipeConfig, sequence_parallel_size: int) -> None:
    """ValueError unless ``upipe.ring_size`` R splits the sequence-parallel group into C_u x R."""
    ring = upipe.ring_size
    if sequence_parallel_size % ring:
        divisors = [d for d in range(1, sequence_parallel_size + 1) if sequence_parallel_size % d == 0]
        raise ValueError(
            f"invalid ds_config: upipe.ring_size: got {ring} for sequence_parallel_size={sequence_parallel_size}; "
            f"allowed: a divisor of sequence_parallel_size {divisors} (the sequence-parallel group is the Ulysses "
            "degree x the ring size)"
        )
    if ring > 1 and not upipe.enabled:
        raise ValueError(
            f"invalid ds_config: upipe.ring_size: got {ring} with upipe.enabled=false; allowed: 1 (DeepSpeed ALST's "
            "Ulysses has no ring attention; set upipe.enabled=true for UPipe x Ring)"
        )


def check_world(sequence_parallel_size: int, world_size: int) -> int:
    """The data-parallel size world/sp; ValueError unless sp divides the world."""
    if world_size % sequence_parallel_size != 0:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"invalid ds_config: sequence_parallel_size: got {sequence_parallel_size} for a world of {world_size} "
            f"processes; allowed: a divisor of the world size {divisors}"
        )
    return world_size // sequence_parallel_size


def check_layer_heads(config: Any, sequence_parallel_size: int, ring_size: int = 1) -> None:
    """``check_heads`` for each of a model's head counts (``heads.head_counts``: its layers may differ), the
    error naming the layer (``heads.per_head_counts``)."""
    per_head_counts(head_counts(config), lambda h, kv: check_heads(h, kv, sequence_parallel_size, ring_size))


def check_heads(num_heads: int, num_kv_heads: int, sequence_parallel_size: int, ring_size: int = 1) -> None:
    """ValueError unless the model's heads can be split over the Ulysses degree C_u = sp / ring_size."""
    ulysses_size = sequence_parallel_size // ring_size
    try:
        check_head_counts(num_heads, num_kv_heads, ulysses_size)
    except ValueError as err:
        valid = valid_group_sizes(num_heads, num_kv_heads)
        if ring_size == 1:
            raise ValueError(
                f"invalid ds_config: sequence_parallel_size: got {sequence_parallel_size} for a model with "
                f"num_attention_heads={num_heads}, num_key_value_heads={num_kv_heads}: {err}. "
                f"Allowed sequence_parallel_size for this model: {valid}"
            ) from None
        raise ValueError(
            f"invalid ds_config: upipe.ring_size: got {ring_size} with "
            f"sequence_parallel_size={sequence_parallel_size}, so the heads are split over the Ulysses degree "
            f"{ulysses_size} = {sequence_parallel_size} / {ring_size}; "
            f"a model with num_attention_heads={num_heads}, num_key_value_heads={num_kv_heads} cannot: {err}. "
            f"Allowed Ulysses degrees (sequence_parallel_size / ring_size) for this model: {valid}"
        ) from None


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
