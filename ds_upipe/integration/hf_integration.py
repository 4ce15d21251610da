"""UPipe for the HF ``Trainer`` and ``accelerate launch``: one call, ``enable()``.

accelerate (>= 1.12) and the HF Trainer (transformers >= 5) run DeepSpeed ALST's Ulysses when
``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` is set: ``Accelerator._prepare_deepspeed``
imports ``UlyssesSPAttentionHF`` from ``deepspeed.runtime.sequence_parallel.ulysses_sp`` *at call
time*, calls its ``register_with_transformers`` (which builds the sequence-parallel groups and
returns the mpu) and wraps the data loaders in ``UlyssesSPDataLoaderAdapter``; the Trainer then
computes the loss across the sequence ranks (``deepspeed_sp_compute_loss``).

``enable()`` keeps all of that and changes six things, process-wide, until ``disable()`` (eleven
attributes of deepspeed, transformers and their classes, each named in ``enable``; why process-wide:
``_ORIGINALS``):

1. ``ulysses_sp.UlyssesSPAttentionHF`` becomes ``UPipeSPAttentionHF``.  Called by accelerate, its
   ``register_with_transformers`` reads the ds_config from the accelerator's DeepSpeed plugin and,
   unless its ``"upipe"`` block says ``"enabled": false``, applies UPipe (``_register_upipe``:
   head chunk size, fused projections and kernel from the block); otherwise it runs ALST's own
   registration.  Either way the ds_config's ``activation_checkpointing`` section /
   ``upipe.offload_checkpoints`` then apply to the model's layers, as in ``ds_upipe.initialize``.
   Called directly (DeepSpeed's ALST recipe), it is ALST's registration, argument for argument,
   unless an active plugin's ds_config has a ``"upipe"`` block: then every key of that block reaches
   the model (UPipe if the block enables it, the stack and checkpointing either way): at once for a
   model object, and for a name or path when the model is given to ``deepspeed.initialize`` with the
   returned mpu (point 3's wrapper); a training forward of a model they never reached is refused
   naming them.  What a registration decided is a ``Registration`` kept with its group.
2. The Trainer's loss and evaluation under sequence parallelism (``trainer_sp``): the training loss
   is the token-weighted mean of the whole gradient-accumulation window, as without SP (transformers
   takes the mean of the micro-batch means); the eval/test loaders are sharded over the sequence
   group and every trainer's own prediction step (the Trainer's, TRL's SFTTrainer's) runs on the
   shards, its loss combined into the batch's token mean and reported once per batch, so that
   ``eval_loss`` equals the non-SP run's.  (accelerate registers ALST with ``disable_in_eval=True``
   because without this the eval batches are not sharded.)  ALST registered through (1) keeps SP in
   eval too (``disable_in_eval=False``).  The training loaders check the ranks' batches together,
   pad rows of different lengths to the group's longest and drop TRL's varlen keys
   (``UPipeSPDataLoaderAdapter``); for a vision-language model they give every rank of the group the
   whole sample and its shard of the shifted labels (``hf_patches.data.whole_sample_round``).
3. ``deepspeed.initialize`` given that mpu completes the registration on the model (above), and the
   engine built with it averages gradients over all ranks (``ds_upipe.integration.engine``'s
   correction of DeepSpeed issue #5248), so ZeRO-1/2 gradients equal the non-SP run's as ZeRO-3's do.
4. ``TrainingArguments(deepspeed=...)`` brings up ``deepspeed.comm`` on CPU, so that
   ``from_pretrained`` under ZeRO-3's ``zero.Init`` works there (``_wrap_trainer_config_process``).
5. accelerate's ``DeepSpeedPlugin.deepspeed_config_process`` leaves the ``"upipe"`` block alone: it
   takes every ``"auto"`` in a ds_config for one of its own placeholders, and ``head_chunk_size:
   "auto"`` is measured at registration (``_wrap_deepspeed_config_process``).
6. accelerate's refusal of linear-attention layers under sequence parallelism (which runs before the
   registration) follows the ds_config: under UPipe those layers' mixers run head-sharded
   (``hf_patches.mixers``; the registration refuses the kinds it cannot run), so hybrid models train;
   under ALST every registered mixer kind is refused (``refuse_unexchanged_mixers``), also where
   accelerate's ``layer_types`` test misses it (Nemotron-H's ``layers_block_type``, LFM2's convs).

Call ``enable()`` once before ``Trainer(...)`` / ``accelerator.prepare(...)``.  Docs:
docs/trainer_accelerate.md.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from deepspeed.runtime.sequence_parallel import ulysses_sp
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

from hf_patches import ATTN_IMPLEMENTATION, UPipeState, long_context_stack, upipe_state
from hf_patches.attention import upipe_attention_function
from hf_patches.data import ShardedBatch, checked_loader, use_zigzag_shift_labels, whole_sample_round
from hf_patches.inputs import check_and_prepare, global_sequence
from hf_patches.state import DOCUMENTS_KWARG
from hf_patches.vlm import vision_language_parts

from ..heads import head_counts
from . import trainer_sp
from .agreement import agreed_settings, check_ranks_agree
from .auto_chunk import run_head_chunk_size
from .config import SPSettings, check_layer_heads, parse_config, tiled
from .sp_setup import (
    average_gradients_over_all_ranks,
    check_model_settings,
    configure_activation_checkpointing,
    packed_rows_per_document,
    prepare_for_run,
    refuse_unexchanged_mixers,
)

#: what enable() replaced, to restore in disable(): (owner, attribute) -> original.  enable() is a
#: process-wide switch by design: accelerate and the Trainer reach ALST through module attributes they
#: look up at call time (``ulysses_sp.UlyssesSPAttentionHF``, ``deepspeed.initialize``, the Trainer's
#: methods), and replacing those attributes is the only hook they offer; in particular
#: ``deepspeed.initialize`` is where accelerate's engine first meets the model and the mpu, which is
#: where a registration by name or path can apply its model keys and where the engine's gradient
#: average is corrected.  Each replacement holds no state: everything a registration decides lives
#: on its ``Registration`` (found from the mpu it is given, weakly keyed by its group) and on the
#: models it patched, so a second model or group never sees another's.
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def enable() -> None:
    """Route accelerate's / the Trainer's DeepSpeed sequence parallelism through ds_upipe (idempotent)."""
    if _ORIGINALS:
        return
    from transformers import Trainer
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    _patch(ulysses_sp, "UlyssesSPAttentionHF", UPipeSPAttentionHF)
    _patch(ulysses_sp, "UlyssesSPDataLoaderAdapter", UPipeSPDataLoaderAdapter)
    _patch(
        HfTrainerDeepSpeedConfig,
        "trainer_config_process",
        _wrap_trainer_config_process(HfTrainerDeepSpeedConfig.trainer_config_process),
    )
    _patch(deepspeed, "initialize", _wrap_initialize(deepspeed.initialize))
    from accelerate import accelerator
    from accelerate.utils import DeepSpeedPlugin

    # accelerate calls it by its module-level name in accelerator.py, before the registration (point 6)
    _patch(accelerator, _ACCELERATE_REFUSAL, _wrap_recurrent_refusal(getattr(accelerator, _ACCELERATE_REFUSAL)))
    _patch(
        DeepSpeedPlugin,
        "deepspeed_config_process",
        _wrap_deepspeed_config_process(DeepSpeedPlugin.deepspeed_config_process),
    )
    for name in ("get_eval_dataloader", "get_test_dataloader"):
        _patch(Trainer, name, trainer_sp.wrap_eval_loader(getattr(Trainer, name), ring_size_of, vision_language_of))
    _patch(Trainer, "evaluation_loop", trainer_sp.wrap_evaluation_loop(Trainer.evaluation_loop))
    _patch(Trainer, "compute_loss", trainer_sp.wrap_compute_loss(Trainer.compute_loss))
    _patch(Trainer, "get_batch_samples", trainer_sp.wrap_get_batch_samples(Trainer.get_batch_samples))
    _patch(Trainer, "training_step", trainer_sp.wrap_training_step(Trainer.training_step))
    _patch(Trainer, "floating_point_ops", trainer_sp.wrap_floating_point_ops(Trainer.floating_point_ops))
    _patch(Trainer, "_track_num_input_tokens", trainer_sp.wrap_track_num_input_tokens(Trainer._track_num_input_tokens))


def disable() -> None:
    """Undo ``enable()`` (models already patched stay patched)."""
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()


def is_enabled() -> bool:
    return bool(_ORIGINALS)


def _patch(owner: Any, name: str, value: Any) -> None:
    _ORIGINALS[(owner, name)] = getattr(owner, name)
    setattr(owner, name, value)


# ---------------------------------------------------------------------------------------------------
# registration (point 1)


@dataclass
class Registration:
    """What one ``register_with_transformers`` call of ours decided, kept with the sequence-parallel
    group it set up (``registration_of(mpu)``), never in a process global: a later registration
    (new groups) or a re-created group never sees it.  It applies the ds_config's model-level keys
    to a model object (``apply_to_model``): at registration when given one, else when the model is
    given to ``deepspeed.initialize`` with this mpu (DeepSpeed's ALST recipe by name or path)."""

    mpu: Any
    #: the validated ds_config (None: ALST's own registration, without a "upipe" block to honour)
    settings: SPSettings | None
    ds_config: dict[str, Any] | None
    #: engines built with this mpu average gradients over all ranks (point 3)
    corrects_gradients: bool
    #: UPipe: U and the core attention implementation it registered under
    head_chunk_size: int | None = None
    core: str | None = None
    disable_in_eval: bool = False
    #: a vision-language model object registered under UPipe: the loaders give every rank the whole sample
    #: (``hf_patches.data.whole_sample_round``)
    vision_language: bool = False

    @property
    def upipe(self) -> bool:
        return self.settings is not None and self.settings.upipe.enabled

    @property
    def ring_size(self) -> int:
        return self.settings.ring_size if self.upipe else 1

    def model_keys(self) -> list[str]:
        """The keys that are on and act on a model object (patching, the stack, checkpointing): on a
        model given only by name or path they need ``apply_to_model``."""
        if self.settings is None:
            return []
        upipe = self.settings.upipe
        on = {
            "upipe.fused_projections=true": self.upipe and upipe.fused_projections,
            "upipe.recompute_attention_output=true": self.upipe and upipe.recompute_attention_output,
            "upipe.tiled_loss": tiled(upipe.tiled_loss)[0],
            "upipe.tiled_norm": tiled(upipe.tiled_norm)[0],
            "upipe.tiled_mlp": tiled(upipe.tiled_mlp)[0],
            "upipe.offload_checkpoints=true": upipe.offload_checkpoints,
            "the activation_checkpointing section": (self.ds_config or {}).get("activation_checkpointing") is not None,
            f"upipe.checkpoint_pairs={upipe.checkpoint_pairs}": upipe.checkpoint_pairs > 0,
            f"upipe.checkpoint_groups={upipe.checkpoint_groups}": upipe.checkpoint_groups > 0,
        }
        return [key for key, value in on.items() if value]

    def apply_to_model(self, model: torch.nn.Module) -> None:
        """The ds_config's model-level keys on ``model``: UPipe patched in place (fused projections,
        recompute, accumulation, U, kernel, overlap, ring), the long-context stack ("local": the
        Trainer / accelerate / ALST's recipe combine the ranks' losses) and activation checkpointing.
        Raises (the same on every rank) before any collective if the model cannot take them."""
        assert self.settings is not None and self.ds_config is not None
        refuse_vision_language(model, self.settings, registered=self.vision_language)
        check_model_settings(model, self.settings)
        prepare_for_run(
            model,
            self.settings,
            sequence_group=self.mpu.get_sequence_parallel_group() if self.upipe else None,
            head_chunk_size=self.head_chunk_size,
            forward_loss="local",
            loss_group=None,
        )
        if self.upipe and self.disable_in_eval:
            _sequence_parallel_in_training_only(model, self.core)
        configure_activation_checkpointing(model, self.ds_config, self.settings, self.mpu)
        for module in model.modules():  # per model: its attention calls check this (_check_applied)
            module.__dict__[_APPLIED] = True

    def unapplied_error(self, module: torch.nn.Module) -> ValueError:
        keys = ", ".join(self.model_keys())
        return ValueError(
            f"ds_upipe: {type(module).__name__} trains under a register_with_transformers registration by name or "
            f"path (DeepSpeed's ALST recipe), but the accelerate plugin's ds_config \"upipe\" block sets {keys}, "
            "which act on the model object, and this model was not given one: pass it to "
            "deepspeed.initialize(model=model, mpu=mpu) with the mpu register_with_transformers returned (which "
            "applies them), register with the model object (model_name_or_path=model), or turn them off in the "
            "ds_config (e.g. upipe.fused_projections: false)"
        )


#: set on every module of a model a registration applied its model-level keys to
_APPLIED = "_upipe_registration_applied"

#: the sequence-parallel group -> the registration that set it up (weak keys: the entry goes with the
#: group; a registration is found from the mpu the user holds, never from "the last one")
_REGISTRATIONS: weakref.WeakKeyDictionary[Any, Registration] = weakref.WeakKeyDictionary()


def registration_of(mpu: Any) -> Registration | None:
    """The registration whose groups ``mpu`` (or a sequence-parallel group) carries now (None: none of ours)."""
    group = mpu.get_sequence_parallel_group() if hasattr(mpu, "get_sequence_parallel_group") else mpu
    try:
        return _REGISTRATIONS.get(group) if group is not None else None
    except TypeError:  # not weakly referenceable: not a group of ours
        return None


def ring_size_of(group: Any) -> int:
    """The ring size UPipe was registered with on this sequence-parallel group (1: none, or ALST)."""
    registration = registration_of(group)
    return 1 if registration is None else registration.ring_size


def vision_language_of(group: Any) -> bool:
    """Whether UPipe was registered on this sequence-parallel group for a vision-language model (its loaders
    give whole samples)."""
    registration = registration_of(group)
    return registration is not None and registration.vision_language


def _record(registration: Registration) -> Registration:
    _REGISTRATIONS[registration.mpu.get_sequence_parallel_group()] = registration
    return registration


def _check_applied(module: torch.nn.Module, registration: Registration) -> None:
    """Refuse a training forward of a model the registration's model-level keys never reached."""
    if module.training and not module.__dict__.get(_APPLIED) and registration.model_keys():
        raise registration.unapplied_error(module)


def _active_ds_config() -> dict[str, Any] | None:
    """The ds_config of the active accelerate DeepSpeed plugin, None when there is none."""
    from accelerate.state import AcceleratorState, is_initialized

    plugin = AcceleratorState().deepspeed_plugin if is_initialized() else None
    return None if plugin is None else plugin.deepspeed_config


def ds_config_from_accelerate() -> dict[str, Any]:
    """The ds_config of the active accelerate DeepSpeed plugin (Trainer: ``TrainingArguments.deepspeed``)."""
    ds_config = _active_ds_config()
    if ds_config is None:
        raise ValueError(
            "ds_upipe.hf_integration: no accelerate DeepSpeed plugin is active, so there is no ds_config to read the "
            '"upipe" block from; use TrainingArguments(deepspeed=...) or an accelerate config with distributed_type: '
            "DEEPSPEED"
        )
    return ds_config


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
    """ALST's ``UlyssesSPAttentionHF`` whose registration applies UPipe when the ds_config asks for it.

    ``register_with_transformers`` keeps ALST's signature, checks, messages and return (the mpu).
    Called by accelerate (its ``ParallelismConfig(sp_backend="deepspeed")`` is active), it reads the
    plugin's ds_config as ``ds_upipe.initialize`` does: UPipe unless ``"upipe": {"enabled": false}``,
    and sequence parallelism stays on in evaluation (module docstring, points 1 and 2).  Called
    directly (DeepSpeed's own ALST recipe), it is ALST's registration, argument for argument,
    unless an active accelerate DeepSpeed plugin's ds_config has a ``"upipe"`` block: its long-context
    stack then applies to a model object, and if it enables UPipe, UPipe honours the same arguments
    (``_register_upipe``)."""

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
        args = {
            "model_name_or_path": model_name_or_path,
            "core_attn_implementation": core_attn_implementation,
            "sequence_parallel_size": sequence_parallel_size,
            "micro_batch_size": micro_batch_size,
            "seq_length": seq_length,
            "seq_length_is_variable": seq_length_is_variable,
            "disable_in_eval": disable_in_eval,
            "max_length": max_length,
        }
        if sequence_parallel_size == 1:
            return _alst_register(args)  # None
        if _accelerate_runs_deepspeed_sp():
            return _register_for_accelerate(args)
        return _register_direct(args)


class UPipeSPDataLoaderAdapter(UlyssesSPDataLoaderAdapter):
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (what accelerate wraps the training loaders in) over
    ``hf_patches.data.checked_loader``: the ranks' batches checked together (the same error on every
    rank), rows of different lengths padded to the group's longest (TRL's dynamic padding; gloo
    cannot all_gather different sizes), TRL's varlen keys dropped and, when UPipe x Ring was
    registered, each rank given its zigzag shard.  Its micro-batches are ``hf_patches.data.ShardedBatch``
    es: each carries the ``SourceBatch`` it was cut from, for the counts the Trainer and TRL log
    (``trainer_sp.per_batch_metrics``); the rows accelerate repeats to even out a last round add no
    loss and no metric (``trainer_sp.accelerate_dataset_samples``)."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any) -> None:
        ring_size = ring_size_of(sp_group)
        # hf_patches.sequence_parallel_dataloader (the eval loaders) passes a checked loader already,
        # and puts the zigzag shift_labels in place itself
        self.reorders = ring_size > 1 and not getattr(dl, "zigzag_ordered", False)
        #: a vision-language model: every rank gets each whole sample, not a shard of it
        self.vision_language = vision_language_of(sp_group)
        dataset_samples = trainer_sp.accelerate_dataset_samples(dl)
        dl = checked_loader(
            dl,
            sp_group,
            device,
            ring_size=ring_size,
            dataset_samples=dataset_samples,
            vision_language=self.vision_language,
        )
        super().__init__(dl, sp_rank, sp_group, sp_world_size, device)

    def refill(self) -> None:
        """DeepSpeed's refill (one micro-batch per rank of the group, in rank order), each micro-batch
        then given its source batch (the checked loader exchanged them with the batches' sizes); for a
        vision-language model the same round of whole samples (``whole_sample_round``)."""
        if self.vision_language:
            try:
                batch = next(self.iter)
            except StopIteration:  # DeepSpeed's refill: the next epoch starts a new iterator
                self.iter = iter(self.dl)
                raise
            self.micro_batches.extend(whole_sample_round(batch, self.sp_group, self.device, self.dl.round_sources))
            return
        super().refill()
        sources = self.dl.round_sources
        fresh = [self.micro_batches.pop() for _ in sources][::-1]
        self.micro_batches.extend(ShardedBatch(b, source=s) for b, s in zip(fresh, sources, strict=True))

    def __next__(self) -> dict[str, Any]:
        batch = super().__next__()
        if self.reorders:
            use_zigzag_shift_labels(batch)
        return batch


def _alst_register(args: dict[str, Any]) -> Any:
    """DeepSpeed ALST's own ``register_with_transformers`` (the class enable() replaced)."""
    return UlyssesSPAttentionHF.register_with_transformers(**args)


def _accelerate_runs_deepspeed_sp() -> bool:
    """Whether accelerate (or the Trainer) runs DeepSpeed sequence parallelism in this process."""
    from accelerate.state import AcceleratorState, is_initialized

    return is_initialized() and trainer_sp.runs_deepspeed_sp(getattr(AcceleratorState(), "parallelism_config", None))


def _register_for_accelerate(args: dict[str, Any]) -> Any:
    ds_config = ds_config_from_accelerate()
    _init_deepspeed_comm()
    settings = _settings_agreed_by_all_ranks(ds_config, args["sequence_parallel_size"])
    # accelerate shards every loader it prepares, and enable() the Trainer's eval loaders: eval
    # batches are sequence shards, so SP must stay on in evaluation (accelerate asks for
    # disable_in_eval=True because without enable() the Trainer's eval batches are not sharded)
    args = {**args, "disable_in_eval": False}
    model = args["model_name_or_path"]  # accelerate passes the model object
    refuse_vision_language(model, settings)  # before the registration's collectives (group creation)
    check_model_settings(model, settings)
    if settings.upipe.enabled:
        mpu, head_chunk_size = _register_upipe(args, settings)
    else:  # ALST from the ds_config: exact on packed rows with sdpa too
        packed_rows_per_document(args["core_attn_implementation"])
        mpu, head_chunk_size = _alst_register(args), None
    registration = Registration(
        mpu,
        settings,
        ds_config,
        True,
        head_chunk_size,
        args["core_attn_implementation"],
        args["disable_in_eval"],
        vision_language=_is_vision_language(model, settings),
    )
    _record(registration).apply_to_model(model)
    return mpu


def _register_direct(args: dict[str, Any]) -> Any:
    """A direct call: ALST's registration unchanged unless the active plugin's ds_config has a "upipe"
    block.  Then its keys reach the model: at once for a model object, and for a name or path when
    the model loaded from it is given to ``deepspeed.initialize`` with the returned mpu (a training
    forward of a model they never reached is refused, ``_check_applied``)."""
    ds_config = _active_ds_config()
    settings = None
    if ds_config is not None and ds_config.get("upipe") is not None:
        _init_deepspeed_comm()
        settings = _settings_agreed_by_all_ranks(ds_config, args["sequence_parallel_size"])
    model = args["model_name_or_path"]
    is_module = isinstance(model, torch.nn.Module)
    if settings is not None and is_module:
        refuse_vision_language(model, settings)  # before the registration's collectives
        check_model_settings(model, settings)
    if settings is not None and settings.upipe.enabled:
        _init_deepspeed_comm()
        mpu, head_chunk_size = _register_upipe(args, settings)
    else:
        mpu, head_chunk_size = _alst_register(args), None
    # the engine built with ALST's mpu keeps DeepSpeed's own gradient average (ALST's recipe's loss)
    registration = _record(
        Registration(
            mpu,
            settings,
            ds_config if settings is not None else None,
            corrects_gradients=settings is not None and settings.upipe.enabled,
            head_chunk_size=head_chunk_size,
            core=args["core_attn_implementation"],
            disable_in_eval=args["disable_in_eval"],
            vision_language=settings is not None and is_module and _is_vision_language(model, settings),
        )
    )
    if settings is None:
        return mpu
    if is_module:
        # the block's long-context stack and checkpointing apply to ALST too ("enabled": false), so that
        # both run on the same stack
        registration.apply_to_model(model)
    if not settings.upipe.enabled and registration.model_keys():
        _guard_alst_function(registration)
    return mpu


def _is_vision_language(model: Any, settings: SPSettings) -> bool:
    """A vision-language model object that UPipe runs under sequence parallelism (its loaders give whole samples)."""
    sequence_parallel = settings.sequence_parallel_size > 1 and settings.upipe.enabled
    return sequence_parallel and isinstance(model, torch.nn.Module) and vision_language_parts(model) is not None


def refuse_vision_language(model: Any, settings: SPSettings, *, registered: bool = True) -> None:
    """What this route still cannot run for a vision-language model under UPipe, refused by name (the same on every
    rank, from the model's structure): one under ALST (its loaders shard), one registered by name or path
    (``registered`` False: the registration could not tell the loaders to give whole samples; DeepSpeed's ALST
    recipe).  A model object registered by
    the Trainer / accelerate / TRL trains: its loaders give every rank the whole sample
    (``hf_patches.data.whole_sample_round``)."""
    alst = settings.sequence_parallel_size > 1 and not settings.upipe.enabled
    if alst and isinstance(model, torch.nn.Module) and vision_language_parts(model) is not None:
        raise ValueError(
            f"ds_upipe: {type(model).__name__} is a vision-language model under DeepSpeed ALST "
            '("upipe": {"enabled": false}): its loaders shard each batch before the model merges the images; '
            "run it under UPipe (docs/vlm.md)"
        )
    if not _is_vision_language(model, settings):
        return
    name = type(model).__name__
    if not registered:
        raise ValueError(
            f"ds_upipe: {name} is a vision-language model registered by name or path (register_with_transformers "
            "without the model object): its loaders would shard each batch, while UPipe's vision-language forward "
            "takes the whole sample on every rank (docs/vlm.md); register with the model object "
            "(model_name_or_path=model) or use the Trainer / accelerate / TRL"
        )


def _guard_alst_function(registration: Registration) -> None:
    """ALST registered by name or path with a "upipe" block whose stack / checkpointing keys are on: its
    attention function refuses a training forward of a model those keys never reached."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core = registration.core
    alst_function = ALL_ATTENTION_FUNCTIONS[core]

    def attention(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        _check_applied(module, registration)
        return alst_function(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[core] = attention


def _settings_agreed_by_all_ranks(ds_config: dict[str, Any], sequence_parallel_size: int) -> SPSettings:
    """``upipe_settings`` of this rank's ds_config, after one exchange with every rank: a config error
    on any rank, or settings that differ between ranks (sequence_parallel_size, the upipe block,
    zero_optimization, ...), raise the same ValueError on every rank before the registration's
    first collective (group creation), as ``ds_upipe.initialize`` does
    (``ds_upipe.integration.agreement``)."""
    settings, error = None, None
    try:
        settings = upipe_settings(ds_config, sequence_parallel_size)
    except ValueError as err:
        error = str(err)
    given = {**ds_config, "sequence_parallel_size": sequence_parallel_size}
    check_ranks_agree(error, agreed_settings(given, settings.upipe if settings is not None else None))
    return settings


def _register_upipe(args: dict[str, Any], settings: SPSettings) -> tuple[Any, int]:
    """UPipe where ALST's registration would put Ulysses; returns (the mpu, U).

    ALST's own registration runs first, for its checks and messages (seq_length, eager and unknown
    implementations, the model's implementation against ``core_attn_implementation``, head counts),
    the hub-kernel loading and the sequence-parallel groups; its attention wrapper is then replaced.
    As in ALST, the function registered under ``core_attn_implementation`` runs sequence-parallel
    attention (UPipe's stage loop, unfused, with the block's U, kernel, overlap, ring and
    accumulation) for every model using that implementation, and a model or path given only for
    its config works.  A model object is moreover patched in place (``Registration.apply_to_model``:
    ``hf_patches.apply_upipe``, fused projections, input checks).  ``disable_in_eval=True``: in eval
    mode both run the plain core attention on the ranks' full inputs, as ALST's does."""
    model, core = args["model_name_or_path"], args["core_attn_implementation"]
    if settings.ring_size == 1:
        mpu, core_function = _alst_checks_and_groups(args)
    else:
        # ALST's registration would refuse heads that do not split over the whole sp group, which is
        # what a ring lifts (they split over C_u): build the groups directly
        mpu, core_function = _ring_groups_and_core(args)
    # ALST's way to the config: the model's (duck-typed, PEFT wrappers too), or loaded from the name/path
    if hasattr(model, "config"):
        config = model.config
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    text = config.get_text_config()
    sp = args["sequence_parallel_size"]
    check_layer_heads(text, sp, settings.ring_size)
    # "auto" measures this model's attention as it will run: fused projections where a model object is
    # patched (Registration.apply_to_model, now or at deepspeed.initialize; by name or path a model-level
    # key such as fused_projections needs that too), unless apply_upipe falls back for this model
    head_chunk_size = run_head_chunk_size(
        settings, model if hasattr(model, "config") else config, args["micro_batch_size"] or 1
    )
    group = mpu.get_sequence_parallel_group()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if _is_vision_language(model, settings):
        # its vision tower runs ``core`` on its own images (hf_patches.vlm); apply_upipe gives the text model
        # UPipe's attention implementation when the registration patches the model object
        return mpu, head_chunk_size
    state = _unfused_state(text, group, head_chunk_size, settings)
    ALL_ATTENTION_FUNCTIONS[core] = _upipe_core_attention(state, core, core_function, args["disable_in_eval"], group)
    return mpu, head_chunk_size


def _ring_groups_and_core(args: dict[str, Any]) -> tuple[Any, Callable[..., Any]]:
    """(the sequence-parallel mpu, the core attention function) without ALST's registration."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .sp_setup import sequence_parallel_mpu

    core = args["core_attn_implementation"]
    if core not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"core_attn_implementation={core!r} is not a registered transformers attention function; UPipe x Ring "
            "needs one of " + ", ".join(sorted(ALL_ATTENTION_FUNCTIONS.keys()))
        )
    return sequence_parallel_mpu(args["sequence_parallel_size"]), ALL_ATTENTION_FUNCTIONS[core]


def _alst_checks_and_groups(args: dict[str, Any]) -> tuple[Any, Callable[..., Any]]:
    """ALST's registration with its attention wrapper taken out again: (mpu, the core function it wrapped)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core = args["core_attn_implementation"]
    before = ALL_ATTENTION_FUNCTIONS.get(core)  # None for a hub kernel: ALST registers it
    mpu = _alst_register(args)
    del ALL_ATTENTION_FUNCTIONS[core]  # ALST's wrapper, set by item assignment (the local override)
    if before is not None and ALL_ATTENTION_FUNCTIONS.get(core) is not before:
        ALL_ATTENTION_FUNCTIONS[core] = before  # an earlier local override
    return mpu, ALL_ATTENTION_FUNCTIONS[core]


def _unfused_state(text_config: Any, group: Any, head_chunk_size: int, settings: SPSettings) -> Any:
    """The runtime of the registered core attention function (the unfused path), built as
    ``apply_upipe`` builds a patched model's (``UPipeState.build``) from the block's settings."""

    from .sp_setup import upipe_groups

    ulysses_group, ring_group = upipe_groups(group, settings)
    return UPipeState.build(
        settings.upipe.options(head_chunk_size),
        group=ulysses_group,
        layer_heads=head_counts(text_config),  # one plan per layers' head counts
        ring_group=ring_group,
        fused_projections=False,
        architecture=getattr(text_config, "model_type", ""),
    )


def _upipe_core_attention(
    state: Any, core: str, core_function: Callable[..., Any], disable_in_eval: bool, group: Any
) -> Callable[..., Any]:
    """The function registered under ``core``: what ALST's ``uattn_wrapper`` is to ALST, with UPipe.
    ``group``: the registration's sequence-parallel group (its ``Registration``, looked up per call:
    recorded once the registration is complete)."""

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if disable_in_eval and not module.training:
            # ALST's bypass: the core function on the local (full) sequence, without the 4-D mask
            # ALST drops (flex_attention's BlockMask is kept)
            return core_function(module, query, key, value, _alst_mask(core, attention_mask), *args, **kwargs)
        if getattr(module, "_upipe_state", None) is None:  # a model the registration did not patch
            registration = registration_of(group)
            if registration is not None:
                _check_applied(module, registration)
            module._upipe_state = state  # upipe_attention_function reads the plan, group and kernel here
        documents = _check_global_positions(module, kwargs.get("position_ids"), state)
        # HF built the mask for the local shard; UPipe's kernel is causal over the gathered sequence
        return upipe_attention_function(
            module, query, key, value, None, *args, **{**kwargs, DOCUMENTS_KWARG: documents}
        )

    return attention


def _alst_mask(core: str, attention_mask: Any) -> Any:
    if core == "flex_attention":
        from torch.nn.attention.flex_attention import BlockMask

        if isinstance(attention_mask, BlockMask):
            return attention_mask
    return None


def _check_global_positions(module: torch.nn.Module, position_ids: torch.Tensor | None, state: Any) -> Any:
    """UPipe's kernel needs the global sequence's positions: gather them (as ALST does in every
    attention call), refuse shuffled ones under a ring, and return this call's packed documents
    (positions that restart, ``ds_upipe.packing``; None without); the same data gives the same result
    on every rank.  A checkpoint replay recomputes them from the position_ids it replays with."""
    if position_ids is None:
        raise ValueError(
            f"{type(module).__name__}: position_ids are required under sequence parallelism: pass the global "
            "positions of each rank's shard (UlyssesSPDataLoaderAdapter adds them)"
        )

    from ..packing import documents_from_positions

    full = global_sequence(position_ids.reshape(-1, position_ids.shape[-1]).contiguous(), state)
    if state.ring_size > 1 and bool((full[:, 1:] - full[:, :-1] != 1).any()):
        raise ValueError(
            f"{type(module).__name__}: position_ids are not consecutive over the whole sequence (in the ring's zigzag "
            "order); packed sequences (positions that restart) are not supported with a ring group"
        )
    return documents_from_positions(full)


def _sequence_parallel_in_training_only(model: torch.nn.Module, core: str) -> None:
    """``disable_in_eval=True`` for a model patched in place: in eval mode it runs with attention
    implementation ``core`` (the registered function, which bypasses SP in eval) and skips UPipe's
    sequence-shard input check; in training it is UPipe as patched."""

    state = upipe_state(model)
    for module in model.modules():
        handle = module.__dict__.get("_upipe_input_hook")  # apply_upipe's hook on the base model
        if handle is not None:
            handle.remove()

            def prepare(base: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
                impl = ATTN_IMPLEMENTATION if base.training else core
                if base.config._attn_implementation != impl:
                    base.set_attn_implementation(impl)
                return check_and_prepare(base, args, kwargs, base._upipe_state) if base.training else None

            module._upipe_input_hook = module.register_forward_pre_hook(prepare, with_kwargs=True)
        if module.__dict__.get("_upipe_state") is state and "forward" in module.__dict__:  # fused attention
            module._upipe_fused_forward = module.forward
            module.forward = types.MethodType(_fused_forward_in_training_only, module)


def _fused_forward_in_training_only(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    if self.training:
        return self._upipe_fused_forward(*args, **kwargs)
    return type(self).forward(self, *args, **kwargs)


_ACCELERATE_REFUSAL = "_refuse_recurrent_layers_under_sequence_parallelism"


def _wrap_recurrent_refusal(original: Callable[..., Any]) -> Callable[..., Any]:
    """accelerate's refusal of linear-attention layers under SP, decided by the ds_config (point 6): lifted
    under UPipe (anything but ``"upipe": {"enabled": false}``, as the registration reads it; the block is
    validated there, alike on every rank), kept and extended to every mixer kind under ALST."""

    @functools.wraps(original)
    def refuse(model: torch.nn.Module) -> None:
        upipe = ((_active_ds_config() or {}).get("upipe") or {}).get("enabled", True) is not False
        refuse_unexchanged_mixers(model, upipe)
        if not upipe:
            original(model)

    return refuse


def _init_deepspeed_comm() -> None:
    """The sequence-parallel groups are built with ``deepspeed.comm``, which must be up.  On CPU,
    ``PartialState(cpu=True)`` / ``TrainingArguments(use_cpu=True)`` start torch.distributed (gloo)
    without it; DeepSpeed then wraps the existing process group."""
    import deepspeed.comm as ds_comm
    from deepspeed.accelerator import get_accelerator

    if not ds_comm.is_initialized():
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def _wrap_trainer_config_process(original: Callable[..., Any]) -> Callable[..., Any]:
    """Bring up ``deepspeed.comm`` as soon as ``TrainingArguments(deepspeed=...)`` has started torch.distributed.

    With ``use_cpu=True`` accelerate starts torch.distributed (gloo) but not ``deepspeed.comm``.
    ``from_pretrained`` under ZeRO-3 then runs ``deepspeed.zero.Init``, whose DeepSpeed config cannot
    ask deepspeed.comm for the world size, takes 1 and refuses the Trainer's ``train_batch_size``
    (world size x micro batch x accumulation): ``train_batch_size ... 2 != 1 * 1 * 1``.  On GPU
    accelerate initializes deepspeed.comm itself and this is a no-op."""

    @functools.wraps(original)
    def trainer_config_process(self: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        result = original(self, args, *rest, **kwargs)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            _init_deepspeed_comm()
        return result

    return trainer_config_process


def _wrap_deepspeed_config_process(original: Callable[..., Any]) -> Callable[..., Any]:
    """accelerate's ``DeepSpeedPlugin.deepspeed_config_process`` (``accelerator.prepare``, the Trainer's
    too) takes every ``"auto"`` value of the ds_config for one of its own placeholders (batch sizes,
    gradient clipping, ...) and refuses one it has no value for: ``"upipe": {"head_chunk_size": "auto"}``
    is ds_upipe's own (measured at registration), so the ``"upipe"`` block is kept out of that pass."""

    @functools.wraps(original)
    def deepspeed_config_process(self: Any, prefix: str = "", mismatches: Any = None, config: Any = None,
                                 *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        whole = self.deepspeed_config
        if prefix or config is not None or not isinstance(whole, dict) or "upipe" not in whole:
            return original(self, prefix, mismatches, config, *args, **kwargs)
        block = whole.pop("upipe")
        try:
            return original(self, prefix, mismatches, config, *args, **kwargs)
        finally:
            whole["upipe"] = block

    return deepspeed_config_process


# ---------------------------------------------------------------------------------------------------
# gradient average of the engine built with our mpu (point 3)


def _wrap_initialize(original: Callable[..., Any]) -> Callable[..., Any]:
    """``deepspeed.initialize`` that completes the registration whose mpu it is given: the model gets
    the ds_config's model-level keys if the registration could not apply them (a name or path, ALST's
    recipe), and the engine the gradient average over all ranks."""

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        registration = registration_of(kwargs.get("mpu")) if kwargs.get("mpu") is not None else None
        model = kwargs.get("model")
        if kwargs.get("mpu") is None:
            _long_context_without_sp(kwargs)
        elif registration is not None and registration.settings is not None and _unapplied(model):
            registration.apply_to_model(model)
        result = original(*args, **kwargs)
        if registration is not None and registration.corrects_gradients:
            average_gradients_over_all_ranks(result[0])
        return result

    return initialize


def _unapplied(model: Any) -> bool:
    """A model no registration (nor ``ds_upipe.initialize``) has applied a ds_config's keys to yet."""

    if not isinstance(model, torch.nn.Module) or model.__dict__.get(_APPLIED):
        return False
    return upipe_state(model) is None and long_context_stack(model) is None


def _long_context_without_sp(kwargs: dict[str, Any]) -> None:
    """The ``"upipe"`` block's long-context stack on a model that accelerate / the Trainer prepare
    without sequence parallelism (with it, the registration applies the stack), so that a run with
    sp_size 1 trains the same stack; transformers' own loss semantics ("local")."""
    model, ds_config = kwargs.get("model"), kwargs.get("config_params", kwargs.get("config"))
    if not isinstance(model, torch.nn.Module) or not isinstance(ds_config, dict) or not ds_config.get("upipe"):
        return

    if long_context_stack(model) is not None:
        return
    settings = parse_config({**ds_config, "sequence_parallel_size": 1})
    check_model_settings(model, settings)
    prepare_for_run(model, settings, sequence_group=None, head_chunk_size=None, forward_loss="local", loss_group=None)
