"""``ds_upipe.initialize``: ``deepspeed.initialize`` with sequence parallelism switched on from the ds_config.

What it adds to DeepSpeed's own initialize, in order:

1. reads the ds_config (path, dict, or ``args.deepspeed_config``) and validates our part of it
   (ds_upipe.integration.config) before any collective, so a bad config raises the same ValueError on every rank;
2. creates the sequence-parallel groups with DeepSpeed's ``parallel_state_sp`` (contiguous ranks form
   a group; ZeRO shards and reduces over all ranks, its "sequence data parallel" group) and passes
   that module as the engine's mpu, as ALST does;
3. patches the HuggingFace model: UPipe through ``hf_patches.apply_upipe`` or, with
   ``"upipe": {"enabled": false}``, DeepSpeed ALST's Ulysses
   (``UlyssesSPAttentionHF.register_with_transformers``) on the same model;
4. makes the ds_config's ``activation_checkpointing`` section apply to the HF model's layers
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
from collections.abc import Callable
from typing import Any

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from .config import (
    SPSettings,
    check_heads,
    check_world,
    choose_head_chunk_size,
    load_config,
    micro_batch_size,
    parse_config,
)
from .process_exit import release_shm_at_exit

#: attention functions ALST replaced in transformers' process-global registry, to restore them
_REPLACED_ATTENTION: dict[str, Callable[..., Any]] = {}


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
    settings = parse_config(ds_config)
    sp = settings.sequence_parallel_size
    if sp > 1 and (mpu is not None or mesh_param is not None):
        raise ValueError(
            f"sequence_parallel_size={sp}: ds_upipe builds the sequence-parallel groups itself; "
            "pass mpu=None and mesh_param=None"
        )

    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    dp = check_world(sp, dist.get_world_size())
    _undo_earlier_initialize()

    if sp > 1:
        text_config = _hf_text_config(model)
        check_heads(text_config.num_attention_heads, text_config.num_key_value_heads, sp)
        _check_data_parallel_size(ds_config, dp)
        mb = micro_batch_size(ds_config, dp)
        if settings.upipe.enabled:
            mpu = sequence_parallel_mpu(sp)
            head_chunk_size = choose_head_chunk_size(
                settings.upipe,
                num_heads=text_config.num_attention_heads,
                num_kv_heads=text_config.num_key_value_heads,
                head_dim=getattr(text_config, "head_dim", None)
                or text_config.hidden_size // text_config.num_attention_heads,
                group_size=sp,
                micro_batch_size=mb,
                dtype_bytes=settings.dtype_bytes,
            )
            apply_upipe_settings(model, mpu.get_sequence_parallel_group(), head_chunk_size, settings)
        else:
            head_chunk_size = text_config.num_attention_heads  # plain Ulysses: all heads in one stage
            mpu = _register_alst(model, sp, mb)
    else:
        head_chunk_size = None

    configure_activation_checkpointing(model, ds_config, settings, mpu if sp > 1 else None)

    sp_loader = None
    if training_data is not None and sp > 1:
        # DeepSpeed's own loader asks the mpu for data-parallel ranks, which parallel_state_sp lacks,
        # and would not shard sequences: build the loader here and hand DeepSpeed none.
        sp_loader = _sequence_parallel_loader(training_data, collate_fn, mb, mpu, dp, sp)
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


def _hf_text_config(model: torch.nn.Module) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise ValueError(
            f"sequence_parallel_size > 1 needs a HuggingFace transformers model (with .config); "
            f"got {type(model).__name__}. For other models use ds_upipe.UPipeDistributedAttention directly."
        )
    return config.get_text_config()


def _check_data_parallel_size(ds_config: dict[str, Any], dp: int) -> None:
    # DeepSpeed builds its own device mesh when both sizes are in the config, which would bypass ours.
    value = ds_config.pop("data_parallel_size", None)
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

    if _REPLACED_ATTENTION:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        for name, fn in _REPLACED_ATTENTION.items():
            ALL_ATTENTION_FUNCTIONS[name] = fn
        _REPLACED_ATTENTION.clear()
    # DeepSpeed sets these module globals only when given an mpu, so a later non-SP engine (and its
    # activation checkpointing) would inherit the sequence-parallel one
    if groups.mpu is parallel_state_sp:
        groups.mpu = None
    if ds_checkpointing.mpu is parallel_state_sp:
        ds_checkpointing.mpu = None


def sequence_parallel_mpu(sp: int) -> Any:
    """DeepSpeed's parallel_state_sp with groups of size ``sp`` (reused if they already exist)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
        if parallel_state_sp.get_sequence_parallel_world_size() == sp:
            return parallel_state_sp
        parallel_state_sp._release_sequence_parallel_groups()
    parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sp)
    return parallel_state_sp


def _register_alst(model: torch.nn.Module, sp: int, mb: int) -> Any:
    """DeepSpeed ALST's Ulysses on this model; returns its mpu (parallel_state_sp)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = model.config._attn_implementation
    if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
        parallel_state_sp._release_sequence_parallel_groups()  # register_with_transformers creates them
    original = ALL_ATTENTION_FUNCTIONS.get(impl)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=impl,
        sequence_parallel_size=sp,
        micro_batch_size=mb,
        seq_length_is_variable=True,
    )
    if original is not None:
        _REPLACED_ATTENTION[impl] = original
    return mpu


def apply_upipe_settings(model: torch.nn.Module, group: Any, head_chunk_size: int, settings: SPSettings) -> None:
    try:
        from hf_patches import apply_upipe
    except ImportError as err:
        raise ValueError(
            "upipe.enabled=true needs hf_patches.apply_upipe (part of ds-upipe); it could not be imported: "
            f"{err}. Set upipe.enabled=false to run DeepSpeed ALST's Ulysses instead"
        ) from err
    upipe = settings.upipe
    apply_upipe(
        model,
        group,
        head_chunk_size=head_chunk_size,
        fused_projections=upipe.fused_projections,
        kernel=upipe.kernel,
        overlap_comm=upipe.overlap_comm,
    )


def configure_activation_checkpointing(
    model: torch.nn.Module, ds_config: dict[str, Any], settings: SPSettings, mpu: Any
) -> None:
    """Make the ds_config's activation_checkpointing section (or upipe.offload_checkpoints) apply.

    HF layers then checkpoint through ``deepspeed.checkpointing.checkpoint``, which keeps only each
    layer's input (sequence-sharded under SP) and, with ``cpu_checkpointing`` or
    ``upipe.offload_checkpoints``, keeps it in host memory until backward.  Partitioning checkpoints
    across the sequence group is refused in ds_upipe.integration.config.  Without either setting a model's own
    HF gradient checkpointing (``gradient_checkpointing_enable``) is left as the user set it."""
    section = ds_config.get("activation_checkpointing")
    offload = settings.upipe.offload_checkpoints
    if section is None and not offload:
        return
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    in_cpu = True if offload else None
    if get_accelerator().device_name() == "cpu":
        # Activations already live in host memory, and DeepSpeed's cpu_checkpointing path breaks
        # there: its copy to "cpu" returns the input itself, which it then empties (checkpointing.py,
        # get_cpu_activations_for_backward), so backward replays the layer on an empty tensor.
        in_cpu = False
    ds_checkpointing.configure(mpu, deepspeed_config=ds_config, checkpoint_in_cpu=in_cpu)
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "_set_gradient_checkpointing"):
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=ds_checkpointing.checkpoint)
        # DeepSpeed's checkpoint is reentrant: backward reaches a layer only if its input requires grad
        model.enable_input_require_grads()


def _sequence_parallel_loader(
    dataset: Dataset, collate_fn: Callable[..., Any] | None, mb: int, mpu: Any, dp: int, sp: int
) -> Any:
    """A loader of this rank's batches (SequenceParallelSampler) wrapped by hf_patches'
    sequence_parallel_dataloader: padding to a multiple of sp, then UlyssesSPDataLoaderAdapter."""
    from hf_patches import sequence_parallel_dataloader

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
        loader, mpu.get_sequence_parallel_group(), device=get_accelerator().current_device_name()
    )


def average_gradients_over_all_ranks(engine: Any) -> None:
    """Make DeepSpeed divide the summed gradients by the world size, and measure their norm right.

    With the full-sequence loss on every rank (module docstring), a sequence group's gradients sum
    to sp times the sample's gradient, and the average that gives the non-SP gradient is
    sum / world_size.  ZeRO-3's default reduce-scatter
    (stage3.py ``__avg_scatter_grads`` via ``reduce_scatter_coalesced``) divides by the world size.
    ZeRO-1/2 divide by ``world_size / sequence_parallel_size`` instead (stage_1_and_2.py:
    ``gradient_reduction_w_predivide``, ``average_tensor``, ``allreduce_bucket``), as do ZeRO-3's
    contiguous all-reduce paths (``__avg_scatter_contiguous_grads``, ``allreduce_bucket``): sp times
    too large, DeepSpeed issue #5248.  That divisor is the optimizer's ``sequence_parallel_size``
    attribute; the only other reader is a switch that forces float32 communication in ZeRO-1/2's
    non-reduce-scatter all-reduce (which then uses the configured communication dtype).  Setting it
    to 1 fixes the average at every ZeRO stage, in one place.

    DeepSpeed's ``BF16_Optimizer`` (ZeRO-1 with bf16 and ``data_types.grad_accum_dtype: fp32``) is
    not a ZeRO optimizer: see ``_fix_bf16_optimizer``."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    optimizer = engine.optimizer
    if isinstance(optimizer, BF16_Optimizer):
        _fix_bf16_optimizer(engine, optimizer)
    elif hasattr(optimizer, "sequence_parallel_size"):
        optimizer.sequence_parallel_size = 1


def _fix_bf16_optimizer(engine: Any, optimizer: Any) -> None:
    """Gradient scale and norm of DeepSpeed's BF16_Optimizer under the sequence-parallel mpu.

    Scale: its gradients are all-reduced by the engine (``_reduce_non_expert_gradients``), which
    divides by ``world_size / engine.sequence_parallel_size``, the same sp-times error as ZeRO-1/2;
    after initialize that division is the attribute's only reader (engine.py), so it is set to 1.

    Norm: every rank then holds the whole averaged float32 gradient.  The optimizer counts a
    gradient only on "tensor-model-parallel rank 0" and sums over the "model-parallel group"
    (``get_grads_for_norm``, ``get_global_norm_of_tensors``), and parallel_state_sp reports the
    sequence-parallel rank and group as those: ranks 1.. of a group count nothing (an empty stack
    raises there).  Without an mpu each rank takes the norm of its own full, identical gradient,
    which is the non-SP norm; the mpu is read nowhere else in the optimizer except Muon's check at
    construction."""
    engine.sequence_parallel_size = 1
    optimizer.mpu = None
