"""``ds_upipe.initialize``: ``deepspeed.initialize`` with sequence parallelism switched on from the ds_config.

What it adds to DeepSpeed's own initialize, in order:

1. reads the ds_config (path, dict, or ``args.deepspeed_config``) and validates our part of it
   (ds_upipe.integration.config); then, before any collective that depends on the config, all ranks
   exchange their validation errors and the settings that must agree
   (ds_upipe.integration.agreement), so a bad config, or configs that differ across ranks, raise
   the same ValueError on every rank;
2. creates the sequence-parallel groups with DeepSpeed's ``parallel_state_sp`` (contiguous ranks form
   a group; ZeRO shards and reduces over all ranks, its "sequence data parallel" group) and passes
   that module as the engine's mpu, as ALST does; with ``"upipe": {"ring_size": R}`` that group stays
   the whole C_u x R group for DeepSpeed, and UPipe runs over its Ulysses and ring subgroups
   (``ds_upipe.ring.build_sequence_groups``);
3. patches the HuggingFace model: UPipe through ``hf_patches.apply_upipe`` or, with
   ``"upipe": {"enabled": false}``, DeepSpeed ALST's Ulysses
   (``UlyssesSPAttentionHF.register_with_transformers``) on the same model;
4. applies the ``"upipe"`` block's long-context stack (``tiled_loss``, ``tiled_norm``, ``tiled_mlp``;
   ``hf_patches.apply_long_context_stack``), checked before any collective; with sequence
   parallelism the model's loss from ``shift_labels`` is then the whole sequence's (tiled
   ``sequence_parallel_loss``), without it transformers' own;
   and makes the ds_config's ``activation_checkpointing`` section apply to the HF model's layers
   (DeepSpeed's checkpoint function, optionally with CPU offload of the checkpointed inputs);
5. shards the training data over the sequence ranks (``hf_patches.sequence_parallel_dataloader``:
   padding, then DeepSpeed's ``UlyssesSPDataLoaderAdapter``) in the sample order of a non-SP run;
6. corrects the ZeRO gradient average so gradients equal the non-SP run at ZeRO 1, 2 and 3 (and the
   average and norm of DeepSpeed's BF16_Optimizer, ZeRO-1 with bf16 and float32 gradient accumulation).

Each rank must backpropagate the full-sequence loss computed from its shard, so that a sequence
group's gradients sum to sp times the sample's: ``hf_patches.sequence_parallel_loss`` (default
``grad_reduction="mean"``) or the ALST / HF Trainer recipe (a differentiable all_gather of the
shard losses, weighted by token counts).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from hf_patches import sequence_parallel_dataloader

from ..cuda_env import avoid_record_streams
from .agreement import agreed_settings, check_ranks_agree
from .auto_chunk import run_head_chunk_size
from .config import check_layer_heads, check_world, load_config, micro_batch_size, parse_config
from .process_exit import release_shm_at_exit
from .sp_setup import (
    average_gradients_over_all_ranks,
    check_model_settings,
    configure_activation_checkpointing,
    model_head_layout,
    prepare_for_run,
    register_alst,
    restore_attention_functions,
    sequence_parallel_mpu,
)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Dataset | None = None,
    lr_scheduler: Any = None,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: str | dict[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | dict[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Same arguments and returns as ``deepspeed.initialize``: (engine, optimizer, training_dataloader,
    lr_scheduler).  With ``sequence_parallel_size`` > 1 the model must be a HuggingFace transformers
    model and the returned training dataloader yields this rank's sequence shard of each batch
    (dicts with ``input_ids``, ``position_ids`` and ``shift_labels``).

    Several engines may be built one after another in one process (sweeps, tests): each call first
    undoes the process-global state an earlier call set (ALST's attention registration, DeepSpeed's
    ``groups.mpu``), so only the newest engine is usable afterwards."""
    if model is None:
        raise ValueError("ds_upipe.initialize requires a model")
    ds_config, args = _resolve_config(args, config if config is not None else config_params)
    settings, error = None, None
    try:  # the config and the model's structure alone; raised below on every rank, after the exchange
        settings = parse_config(ds_config)
        if settings.sequence_parallel_size > 1 and (mpu is not None or mesh_param is not None):
            raise ValueError(
                f"sequence_parallel_size={settings.sequence_parallel_size}: ds_upipe builds the sequence-parallel "
                "groups itself; pass mpu=None and mesh_param=None"
            )
        check_model_settings(model, settings)
    except ValueError as err:
        error = str(err)

    backend = get_accelerator().communication_backend_name()
    avoid_record_streams(backend)  # torch < 2.8 + NCCL: before the group exists (ds_upipe.cuda_env)
    deepspeed.init_distributed(
        dist_backend=backend,
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    _use_local_device()
    # before any collective that depends on the config: the same error on every rank, never a hang
    check_ranks_agree(error, agreed_settings(ds_config, settings.upipe if settings is not None else None))
    assert settings is not None  # no rank had an error
    sp = settings.sequence_parallel_size
    dp = check_world(sp, dist.get_world_size())
    _undo_earlier_initialize()

    if sp > 1:
        layout = model_head_layout(model)  # a HuggingFace model (ValueError naming it otherwise)
        check_layer_heads(model.config, sp, settings.ring_size)
        _check_data_parallel_size(ds_config, dp)
        # ours to change (load_config copied it): DeepSpeed builds its own device mesh when the config
        # has both sizes, which would bypass the sequence-parallel groups
        ds_config.pop("data_parallel_size", None)
        mb = micro_batch_size(ds_config, dp)
        if settings.upipe.enabled:
            mpu = sequence_parallel_mpu(sp)
            # "auto" measures this model's attention as prepare_for_run will patch it
            head_chunk_size = run_head_chunk_size(settings, model, mb)
        else:
            head_chunk_size = layout.num_heads  # plain Ulysses: all heads in one stage
            mpu = register_alst(model, sp, mb)
    else:
        head_chunk_size = None

    # the forward's loss from shift_labels is the whole sequence's (sequence_parallel_loss's semantics)
    sequence_group = mpu.get_sequence_parallel_group() if sp > 1 else None
    prepare_for_run(
        model,
        settings,
        sequence_group=sequence_group if settings.upipe.enabled else None,  # ALST: registered above
        head_chunk_size=head_chunk_size,
        forward_loss="sequence_parallel" if sp > 1 else "local",
        loss_group=sequence_group,
    )
    checkpointing = configure_activation_checkpointing(model, ds_config, settings, mpu if sp > 1 else None)

    sp_loader = None
    if training_data is not None and sp > 1:
        # DeepSpeed's own loader asks the mpu for data-parallel ranks, which parallel_state_sp lacks,
        # and would not shard sequences: build the loader here and hand DeepSpeed none.
        sp_loader = _sequence_parallel_loader(training_data, collate_fn, mb, mpu, dp, sp, settings.ring_size)
        training_data = None

    engine, ds_optimizer, dataloader, scheduler = deepspeed.initialize(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        distributed_port=distributed_port,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=ds_config,
        mesh_param=mesh_param,
    )
    if sp > 1:
        average_gradients_over_all_ranks(engine)
    # every rank is past init_distributed now, so DeepSpeed's CPU shm segment may be unlinked at exit
    dist.barrier()
    release_shm_at_exit()
    # for logs and tests: what this engine runs
    engine.upipe_settings = settings
    engine.upipe_head_chunk_size = head_chunk_size
    engine.upipe_checkpointing = checkpointing
    return engine, ds_optimizer, sp_loader if sp_loader is not None else dataloader, scheduler


class SequenceParallelSampler(Sampler[int]):
    """Sample indices for one rank of a sequence-parallel group.

    ``UlyssesSPDataLoaderAdapter`` trains a group on its ranks' batches in turn (rank 0's k-th batch,
    rank 1's k-th batch, ...).  So rank ``s`` of data-parallel replica ``d`` takes batches s, s+C,
    s+2C, ... of what ``DistributedSampler(num_replicas=dp, rank=d)`` (DeepSpeed's default, same
    shuffle and seed) gives replica d: the SP run sees the very samples, in the very order, of a
    non-SP run on dp ranks.  Only whole rounds of C full batches are used, so every rank of a group
    runs out of data at the same step."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        data_parallel_size: int,
        data_parallel_rank: int,
        sequence_parallel_size: int,
        sequence_parallel_rank: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.base = DistributedSampler(
            dataset, num_replicas=data_parallel_size, rank=data_parallel_rank, shuffle=shuffle, seed=seed
        )
        self.sp_size, self.sp_rank, self.batch_size = sequence_parallel_size, sequence_parallel_rank, batch_size

    def _rounds(self) -> int:
        return len(self.base) // self.batch_size // self.sp_size

    def __iter__(self):
        indices = list(self.base)
        for r in range(self._rounds()):
            start = (r * self.sp_size + self.sp_rank) * self.batch_size
            yield from indices[start : start + self.batch_size]

    def __len__(self) -> int:
        return self._rounds() * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)


# ----------------------------------------------------------------------------------------------------


def _resolve_config(args: Any, config: str | dict[str, Any] | None) -> tuple[dict[str, Any], Any]:
    """The ds_config as a dict, and args without ``deepspeed_config`` (we pass the dict instead)."""
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("got a ds_config both in args.deepspeed_config and in config=; pass one")
        config = from_args
        args = copy.copy(args)
        args.deepspeed_config = None
    if config is None:
        raise ValueError("no ds_config: pass config= (a path or a dict) or args.deepspeed_config")
    return load_config(config), args


def _use_local_device() -> None:
    """Select this process's device (LOCAL_RANK) as DeepSpeed's engine will, already now: NCCL's
    ``all_gather_object`` in the settings exchange runs on the current device."""
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _check_data_parallel_size(ds_config: dict[str, Any], dp: int) -> None:
    value = ds_config.get("data_parallel_size")
    if value is not None and value != dp:
        raise ValueError(
            f"invalid ds_config: data_parallel_size: got {value!r}; allowed: {dp} (world size / "
            "sequence_parallel_size), or leave it out"
        )


def _undo_earlier_initialize() -> None:
    """Restore process-global state an earlier initialize in this process changed."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.utils import groups

    restore_attention_functions()
    # DeepSpeed sets these module globals only when given an mpu, so a later non-SP engine (and its
    # activation checkpointing) would inherit the sequence-parallel one
    if groups.mpu is parallel_state_sp:
        groups.mpu = None
    if ds_checkpointing.mpu is parallel_state_sp:
        ds_checkpointing.mpu = None


def _sequence_parallel_loader(
    dataset: Dataset, collate_fn: Callable[..., Any] | None, mb: int, mpu: Any, dp: int, sp: int, ring_size: int
) -> Any:
    """A loader of this rank's batches (SequenceParallelSampler) wrapped by hf_patches'
    sequence_parallel_dataloader: padding to a multiple of sp, then UlyssesSPDataLoaderAdapter
    (with a ring, zigzag shards over the whole sequence-parallel group)."""

    sampler = SequenceParallelSampler(
        dataset,
        data_parallel_size=dp,
        data_parallel_rank=dist.get_rank() // sp,  # groups are contiguous ranks (parallel_state_sp)
        sequence_parallel_size=sp,
        sequence_parallel_rank=mpu.get_sequence_parallel_rank(),
        batch_size=mb,
    )
    loader = DataLoader(dataset, batch_size=mb, sampler=sampler, collate_fn=collate_fn, drop_last=True)
    return sequence_parallel_dataloader(
        loader, mpu.get_sequence_parallel_group(), device=get_accelerator().current_device_name(), ring_size=ring_size
    )
