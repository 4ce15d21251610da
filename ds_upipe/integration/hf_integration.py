"""UPipe for the HF ``Trainer`` and ``accelerate launch``: one call, ``enable()``.

accelerate (>= 1.12) and the HF Trainer (transformers >= 5) run DeepSpeed ALST's Ulysses when
``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` is set: ``Accelerator._prepare_deepspeed``
imports ``UlyssesSPAttentionHF`` from ``deepspeed.runtime.sequence_parallel.ulysses_sp`` *at call
time*, calls its ``register_with_transformers`` (which builds the sequence-parallel groups and
returns the mpu) and wraps the data loaders in ``UlyssesSPDataLoaderAdapter``; the Trainer then
computes the loss across the sequence ranks (``deepspeed_sp_compute_loss``).

``enable()`` keeps all of that and changes three things, process-wide, until ``disable()``:

1. ``ulysses_sp.UlyssesSPAttentionHF`` becomes ``UPipeSPAttentionHF``.  Its
   ``register_with_transformers`` reads the ds_config from the accelerator's DeepSpeed plugin and,
   when its ``"upipe"`` block is enabled, sets up the same mpu (``parallel_state_sp``) and patches
   the model with ``hf_patches.apply_upipe`` (head chunk size, fused projections and kernel from the
   block).  With ``"upipe": {"enabled": false}`` it runs ALST's own registration.  Either way the
   ds_config's ``activation_checkpointing`` section / ``upipe.offload_checkpoints`` then apply to the
   model's layers, as in ``ds_upipe.initialize``.
2. Evaluation runs under sequence parallelism.  (accelerate registers ALST with
   ``disable_in_eval=True`` because the Trainer's eval batches are not sharded: every rank would run
   attention over the full sequence.)  Here the Trainer's eval/test loaders are sharded over the
   sequence group (``hf_patches.sequence_parallel_dataloader``) and ``Trainer.prediction_step``
   computes the loss across the sequence ranks, reporting each batch's loss once so that
   ``eval_loss`` equals the non-SP run's (also with accelerate's even-batches padding).  ALST
   registered through (1) keeps SP in eval too (``disable_in_eval=False``).
3. The engine built with that mpu averages gradients over all ranks (``ds_upipe.integration.engine``'s
   correction of DeepSpeed issue #5248), so ZeRO-1/2 gradients equal the non-SP run's as ZeRO-3's do.

Call ``enable()`` once before ``Trainer(...)`` / ``accelerator.prepare(...)``.  Docs:
docs/trainer_accelerate.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.sequence_parallel import ulysses_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

from .config import SPSettings, parse_config
from .sp_setup import average_gradients_over_all_ranks, configure_activation_checkpointing, setup_upipe

#: what enable() replaced, to restore in disable(): (owner, attribute) -> original
_ORIGINALS: dict[tuple[Any, str], Any] = {}
#: the mpu our registration returned last (the engine built with it gets the gradient correction)
_REGISTERED: dict[str, Any] = {}


def enable() -> None:
    """Route accelerate's / the Trainer's DeepSpeed sequence parallelism through ds_upipe (idempotent)."""
    if _ORIGINALS:
        return
    from transformers import Trainer

    _patch(ulysses_sp, "UlyssesSPAttentionHF", UPipeSPAttentionHF)
    _patch(deepspeed, "initialize", _wrap_initialize(deepspeed.initialize))
    _patch(Trainer, "get_eval_dataloader", _wrap_eval_loader(Trainer.get_eval_dataloader))
    _patch(Trainer, "get_test_dataloader", _wrap_eval_loader(Trainer.get_test_dataloader))
    _patch(Trainer, "prediction_step", _wrap_prediction_step(Trainer.prediction_step))


def disable() -> None:
    """Undo ``enable()`` (models already patched stay patched)."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()
    _REGISTERED.clear()


def is_enabled() -> bool:
    return bool(_ORIGINALS)


def _patch(owner: Any, name: str, value: Any) -> None:
    _ORIGINALS[(owner, name)] = getattr(owner, name)
    setattr(owner, name, value)


# ---------------------------------------------------------------------------------------------------
# registration (point 1)


def ds_config_from_accelerate() -> dict[str, Any]:
    """The ds_config of the active accelerate DeepSpeed plugin (Trainer: ``TrainingArguments.deepspeed``)."""
    from accelerate.state import AcceleratorState, is_initialized

    plugin = AcceleratorState().deepspeed_plugin if is_initialized() else None
    if plugin is None:
        raise ValueError(
            "ds_upipe.hf_integration: no accelerate DeepSpeed plugin is active, so there is no ds_config to read the "
            '"upipe" block from; use TrainingArguments(deepspeed=...) or an accelerate config with distributed_type: '
            "DEEPSPEED"
        )
    return plugin.deepspeed_config


def upipe_settings(ds_config: dict[str, Any], sequence_parallel_size: int) -> SPSettings:
    """Validate the ds_config for sequence parallelism of size ``sequence_parallel_size`` (ParallelismConfig's sp_size).

    The ds_config may leave out ``sequence_parallel_size`` (accelerate's way); if it gives one it must agree."""
    own = ds_config.get("sequence_parallel_size")
    if own is not None and own != sequence_parallel_size:
        raise ValueError(
            f"invalid ds_config: sequence_parallel_size: got {own!r} but ParallelismConfig.sp_size is "
            f"{sequence_parallel_size}; allowed: {sequence_parallel_size} or leave it out of the ds_config"
        )
    return parse_config({**ds_config, "sequence_parallel_size": sequence_parallel_size})


class UPipeSPAttentionHF(UlyssesSPAttentionHF):
    """ALST's ``UlyssesSPAttentionHF`` whose registration applies UPipe when the ds_config enables it."""

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str | None,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> Any:
        """Same arguments and return (the mpu) as ALST's.  ``disable_in_eval`` is ignored: evaluation
        runs under sequence parallelism on sharded batches (module docstring, point 2)."""
        if sequence_parallel_size == 1:
            return None
        ds_config = ds_config_from_accelerate()
        settings = upipe_settings(ds_config, sequence_parallel_size)
        _init_deepspeed_comm()
        if not settings.upipe.enabled:
            mpu = super().register_with_transformers(
                model_name_or_path,
                core_attn_implementation,
                sequence_parallel_size,
                micro_batch_size,
                seq_length=seq_length,
                seq_length_is_variable=seq_length_is_variable,
                disable_in_eval=False,
                max_length=max_length,
            )
            configure_activation_checkpointing(model_name_or_path, ds_config, settings, mpu)
            _REGISTERED["mpu"] = mpu
            return mpu

        model = model_name_or_path
        if not hasattr(model, "config") or not hasattr(model.config, "get_text_config"):
            raise ValueError(
                f"upipe.enabled=true needs the model object (a transformers model), got {type(model).__name__}: "
                "UPipe patches the model's attention modules in place"
            )
        mpu, _ = setup_upipe(model, settings, micro_batch_size or 1)
        configure_activation_checkpointing(model, ds_config, settings, mpu)
        _REGISTERED["mpu"] = mpu
        return mpu


def _init_deepspeed_comm() -> None:
    """The sequence-parallel groups are built with ``deepspeed.comm``, which must be up.  On CPU,
    ``PartialState(cpu=True)`` / ``TrainingArguments(use_cpu=True)`` start torch.distributed (gloo)
    without it; DeepSpeed then wraps the existing process group."""
    import deepspeed.comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    if not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


# ---------------------------------------------------------------------------------------------------
# gradient average of the engine built with our mpu (point 3)


def _wrap_initialize(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        mpu = _REGISTERED.get("mpu")
        if mpu is not None and kwargs.get("mpu") is mpu:
            average_gradients_over_all_ranks(result[0])
        return result

    return initialize


# ---------------------------------------------------------------------------------------------------
# evaluation under sequence parallelism in the HF Trainer (point 2)


def _deepspeed_sp(trainer: Any) -> Any:
    """The ParallelismConfig when the trainer runs DeepSpeed sequence parallelism, else None."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled:
        return pc
    return None


class SequenceParallelEvalLoader:
    """A prepared eval DataLoader whose batches are sharded over the sequence group when iterated.

    The groups exist only once the model is prepared (``evaluate()`` may build the loader first), so
    sharding starts in ``__iter__``.  Each batch of each rank of a group is processed by the whole
    group in turn (ALST's ``UlyssesSPDataLoaderAdapter``); ``source_rank`` says whose batch the
    current micro-batch is."""

    def __init__(self, loader: Any, sequence_parallel_size: int, device: torch.device) -> None:
        self.loader, self.sp, self.device = loader, sequence_parallel_size, device
        self.source_rank = -1
        self.own_loss: torch.Tensor | None = None

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> Any:
        return getattr(self.loader, "batch_size", None)

    def __len__(self) -> int:
        return len(self.loader) * self.sp

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from deepspeed.utils import groups

        from hf_patches import sequence_parallel_dataloader

        sharded = sequence_parallel_dataloader(self.loader, groups._get_sequence_parallel_group(), device=self.device)
        self.own_loss = None
        for i, batch in enumerate(sharded):
            self.source_rank = i % self.sp
            yield batch
        self.source_rank = -1


def _wrap_eval_loader(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_loader(self: Any, *args: Any, **kwargs: Any) -> Any:
        loader = original(self, *args, **kwargs)
        pc = _deepspeed_sp(self)
        if pc is None or isinstance(loader, SequenceParallelEvalLoader):
            return loader
        return SequenceParallelEvalLoader(loader, pc.sp_size, self.args.device)

    return get_loader


def _wrap_prediction_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prediction_step(
        self: Any,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, None, None]:
        pc = _deepspeed_sp(self)
        if pc is None:
            return original(self, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        loader = self.callback_handler.eval_dataloader
        if not isinstance(loader, SequenceParallelEvalLoader) or "shift_labels" not in inputs:
            raise ValueError(
                "evaluation under sequence parallelism needs batches sharded over the sequence ranks: iterate the "
                "loader returned by Trainer.get_eval_dataloader/get_test_dataloader (ds_upipe.hf_integration wraps "
                f"them); got a {type(loader).__name__} yielding keys {sorted(inputs)}"
            )
        if not prediction_loss_only:
            # logits/labels per rank are sequence shards; gathering them would put the full sequence on each rank
            raise ValueError(
                "prediction_loss_only=False (compute_metrics or predict) is not supported under sequence "
                f"parallelism (sp_size={pc.sp_size}): each rank holds only its shard of the logits; evaluate the loss "
                "only (no compute_metrics, args.prediction_loss_only=True)"
            )
        from deepspeed.utils import groups
        from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = deepspeed_sp_compute_loss(self.accelerator, model, inputs, False, pc).detach()
        # Every rank of the group holds the loss of the same batch.  The loop gathers each step's
        # losses over all ranks, so each rank reports only its own batch's loss, at the group's last
        # micro-batch of the round: the gathered values are then exactly the non-SP run's (and
        # accelerate's truncation of even-batches padding applies to them the same way).
        if loader.source_rank == groups._get_sequence_parallel_rank():
            loader.own_loss = loss
        if loader.source_rank != pc.sp_size - 1:
            return None, None, None
        own, loader.own_loss = loader.own_loss, None
        return own, None, None

    return prediction_step
