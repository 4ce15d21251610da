"""The HF Trainer's (and TRL's SFTTrainer's) loss and evaluation under DeepSpeed sequence parallelism.

What transformers does under ``ParallelismConfig(sp_backend="deepspeed")`` and what ``enable()``
changes (``hf_integration`` installs these wrappers):

- **Training loss under gradient accumulation.**  ``Trainer.compute_loss`` calls
  ``deepspeed_sp_compute_loss``: the token-weighted mean over the sequence ranks of *this*
  micro-batch, which the Trainer then divides by the accumulation steps: the plain mean of the
  micro-batch means.  Without sequence parallelism the Trainer counts the labelled tokens of the
  whole accumulation window (``num_items_in_batch``, over all ranks) and divides each micro-batch's
  token sum by that count: the token-weighted mean of the window.  Here the window's count is taken
  from the sequence shards (``window_token_count``: each token is on one rank) and each micro-step's
  loss is the group's token sum over it (``sequence_parallel_loss``), so the accumulated gradient and
  the logged loss are the non-SP run's.  With ``average_tokens_across_devices=False`` the count is the
  group's own, as the non-SP run's is each rank's.
- **Evaluation.**  The eval batches are sequence shards (``SequenceParallelEvalLoader``), so a
  trainer's own ``prediction_step`` returns the loss of one shard.  ``evaluation_loop`` is wrapped
  to route every trainer's ``prediction_step`` (also a subclass's own, e.g. TRL's ``SFTTrainer``:
  its loss path, fused LM head and metrics run unchanged) through ``sequence_parallel_prediction_step``,
  which combines the shard losses into the batch's token mean and reports each batch once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_patches.data import IGNORE_INDEX


def runs_deepspeed_sp(pc: Any) -> bool:
    """Whether an accelerate ParallelismConfig (or None) runs DeepSpeed sequence parallelism."""
    return pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled


def deepspeed_sp(trainer: Any) -> Any:
    """The ParallelismConfig when the trainer runs DeepSpeed sequence parallelism, else None."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return pc if runs_deepspeed_sp(pc) else None


def _sp_group() -> Any:
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_group()


def _labelled_tokens(inputs: dict[str, Any]) -> torch.Tensor:
    return (inputs["shift_labels"] != IGNORE_INDEX).sum()


def _shard_sums(
    loss: torch.Tensor, tokens: torch.Tensor, group: Any, differentiable: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum over the group's ranks of each rank's token sum of the loss, the group's labelled
    tokens): a rank's token sum is its token mean x its labelled tokens; a shard without labelled
    tokens adds 0, also where its mean is NaN."""
    if differentiable:
        losses = torch.stack(torch.distributed.nn.functional.all_gather(loss, group=group))
    else:
        losses = [torch.empty_like(loss) for _ in range(dist.get_world_size(group))]
        dist.all_gather(losses, loss.contiguous(), group=group)
        losses = torch.stack(losses)
    counts = [torch.empty_like(tokens) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, tokens.contiguous(), group=group)
    counts = torch.stack(counts)
    weights = counts.to(losses.dtype)
    return torch.where(counts > 0, losses * weights, torch.zeros_like(losses)).sum(), counts.sum()


# ---------------------------------------------------------------------------------------------------
# training: the token-weighted mean over the accumulation window


def window_token_count(trainer: Any, batch_samples: list[dict[str, Any]], device: torch.device) -> torch.Tensor:
    """The labelled tokens of this accumulation window: over every rank (each shard's tokens are on one
    rank) with ``average_tokens_across_devices``, else over this rank's sequence group."""
    local = torch.zeros((), dtype=torch.long, device=device)
    for batch in batch_samples:
        local += _labelled_tokens(batch).to(device)
    group = None if trainer.args.average_tokens_across_devices else _sp_group()
    dist.all_reduce(local, group=group)
    return local


def sequence_parallel_loss(
    model: torch.nn.Module, inputs: dict[str, Any], window_tokens: torch.Tensor, over_all_ranks: bool
) -> tuple[torch.Tensor, Any]:
    """(this micro-step's loss, the model's outputs): the group's token sum of the model's own loss over
    the window's labelled tokens, times the data-parallel degree when they were counted over all ranks
    (the engine averages the gradients over all ranks: ``sp_setup.average_gradients_over_all_ranks``)."""
    if "labels" not in inputs:  # the adapter replaced them by shift_labels, which the model's loss prefers
        inputs = {**inputs, "labels": inputs["shift_labels"]}
    outputs = model(**inputs)
    group = _sp_group()
    total, _ = _shard_sums(outputs.loss, _labelled_tokens(inputs).to(outputs.loss.device), group, differentiable=True)
    data_parallel = dist.get_world_size() // dist.get_world_size(group) if over_all_ranks else 1
    return total * data_parallel / window_tokens.clamp(min=1).to(total.dtype), outputs


def refuse_sequence_level_trl_losses(trainer: Any) -> None:
    """TRL's trainers other than SFTTrainer (DPO, KTO, GRPO, RLOO, reward, distillation) compute losses
    from whole sequences (a sequence's summed log-probs, a reward per sequence), which one rank's shard
    does not hold; under sequence parallelism they would train on shards as if they were sequences.
    Refused by name (the same on every rank); the message points at ds_upipe's sequence-parallel DPO trainer
    (``integration.trl_dpo``, a subclass, so not refused here) and its DPO and GRPO losses (``hf_patches.rl_loss``)."""
    module = type(trainer).__module__
    if module.startswith("trl.") and type(trainer).__name__ != "SFTTrainer":
        raise ValueError(
            f"{type(trainer).__name__} under sequence parallelism (sp_size={deepspeed_sp(trainer).sp_size}) is not "
            "supported by ds_upipe: its loss needs each whole sequence (summed log-probs per sequence), and each rank "
            "holds a shard of it. For DPO use ds_upipe.integration.trl_dpo.SequenceParallelDPOTrainer (a drop-in "
            "DPOTrainer); for DPO and GRPO in a loop of your own, hf_patches.rl_loss (sequence_parallel_dpo_loss, "
            "sequence_parallel_grpo_loss): examples/rl_sp.py, docs/trainer_accelerate.md 'Preference and RL training "
            "under SP'. Otherwise train it without sequence parallelism (sp_size 1); TRL's SFTTrainer is supported"
        )


def wrap_get_batch_samples(original: Callable[..., Any]) -> Callable[..., Any]:
    """The training loop's window of micro-batches with its labelled-token count taken from the shards."""

    @functools.wraps(original)
    def get_batch_samples(self: Any, epoch_iterator: Any, num_batches: int, device: torch.device) -> Any:
        sequence_parallel = deepspeed_sp(self) is not None
        if sequence_parallel:
            refuse_sequence_level_trl_losses(self)  # before the loader's first collective
        batch_samples, num_items_in_batch = original(self, epoch_iterator, num_batches, device)
        sharded = bool(batch_samples) and all(isinstance(b, dict) and "shift_labels" in b for b in batch_samples)
        if sequence_parallel and sharded:
            num_items_in_batch = window_token_count(self, batch_samples, device)
        return batch_samples, num_items_in_batch

    return get_batch_samples


def wrap_compute_loss(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compute_loss(
        self: Any,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        sharded = "shift_labels" in inputs and torch.is_tensor(num_items_in_batch)
        if deepspeed_sp(self) is None or not self.model.training or not sharded:
            return original(self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        over_all_ranks = bool(self.args.average_tokens_across_devices)
        loss, outputs = sequence_parallel_loss(model, inputs, num_items_in_batch, over_all_ranks)
        # already normalized over the whole window: the Trainer must not divide it by the steps again
        # (Trainer.loss_is_scaled_for_ga, the documented switch for a compute_loss of one's own)
        self.loss_is_scaled_for_ga = True
        return (loss, outputs) if return_outputs else loss

    return compute_loss


# ---------------------------------------------------------------------------------------------------
# evaluation


class SequenceParallelEvalLoader:
    """A prepared eval DataLoader whose batches are sharded over the sequence group when iterated.

    The groups exist only once the model is prepared (``evaluate()`` may build the loader first), so
    sharding starts in ``__iter__``.  Each batch of each rank of a group is processed by the whole
    group in turn (ALST's ``UlyssesSPDataLoaderAdapter``); ``source_rank`` says whose batch the
    current micro-batch is."""

    def __init__(
        self, loader: Any, sequence_parallel_size: int, device: torch.device, ring_size: Callable[[Any], int]
    ) -> None:
        # ring_size: of the sequence-parallel group, asked when iterating (the group's registration)
        self.loader, self.sp, self.device, self.ring_size = loader, sequence_parallel_size, device, ring_size
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
        from hf_patches import sequence_parallel_dataloader

        group = _sp_group()
        sharded = sequence_parallel_dataloader(self.loader, group, device=self.device, ring_size=self.ring_size(group))
        self.own_loss = None
        for i, batch in enumerate(sharded):
            self.source_rank = i % self.sp
            yield batch
        self.source_rank = -1


def wrap_eval_loader(original: Callable[..., Any], ring_size: Callable[[Any], int]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_loader(self: Any, *args: Any, **kwargs: Any) -> Any:
        loader = original(self, *args, **kwargs)
        pc = deepspeed_sp(self)
        if pc is None or isinstance(loader, SequenceParallelEvalLoader):
            return loader
        return SequenceParallelEvalLoader(loader, pc.sp_size, self.args.device, ring_size)

    return get_loader


def _token_mean_prediction_steps() -> tuple[Callable[..., Any], ...]:
    """The prediction steps whose loss is the language-model loss's token mean over the batch they are
    given (so that shard losses combine by token weights): the Trainer's and TRL's SFTTrainer's."""
    from transformers import Trainer

    steps: list[Callable[..., Any]] = [Trainer.prediction_step]
    try:
        from trl import SFTTrainer
    except ImportError:
        pass
    else:
        steps.append(SFTTrainer.prediction_step)
    return tuple(steps)


def sequence_parallel_prediction_step(
    trainer: Any,
    own_step: Callable[..., Any],
    model: torch.nn.Module,
    inputs: dict[str, Any],
    prediction_loss_only: bool,
    ignore_keys: list[str] | None = None,
) -> tuple[torch.Tensor | None, None, None]:
    """The trainer's own prediction step on this rank's shard, its loss combined over the sequence group
    into the batch's token mean (the non-SP run's loss of the batch), reported once per batch."""
    pc = deepspeed_sp(trainer)
    loader = trainer.callback_handler.eval_dataloader
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

    # the labels the model's loss (and TRL's fused LM head) score: this shard's pre-shifted ones
    inputs = {**inputs, "labels": inputs["shift_labels"]}
    loss, _, _ = own_step(trainer, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
    tokens = _labelled_tokens(inputs).to(loss.device)
    total, total_tokens = _shard_sums(loss.detach().float(), tokens, _sp_group(), differentiable=False)
    loss = total / total_tokens.clamp(min=1)
    # Every rank of the group holds the loss of the same batch.  The loop gathers each step's losses
    # over all ranks, so each rank reports only its own batch's loss, at the group's last micro-batch
    # of the round: the gathered values are then exactly the non-SP run's (and accelerate's
    # truncation of even-batches padding applies to them the same way).
    if loader.source_rank == groups._get_sequence_parallel_rank():
        loader.own_loss = loss
    if loader.source_rank != pc.sp_size - 1:
        return None, None, None
    own, loader.own_loss = loader.own_loss, None
    return own, None, None


def wrap_evaluation_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    """Run the loop with the trainer's own prediction step (its class's: TRL's SFTTrainer has its own)
    under ``sequence_parallel_prediction_step`` while sequence parallelism is on."""

    @functools.wraps(original)
    def evaluation_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        if deepspeed_sp(self) is None:
            return original(self, *args, **kwargs)
        refuse_sequence_level_trl_losses(self)
        own_step = type(self).prediction_step
        if own_step not in _token_mean_prediction_steps():
            raise ValueError(
                f"{type(self).__name__}.prediction_step is its own; evaluation under sequence parallelism combines "
                "the ranks' shard losses as token means of the language-model loss, which only the Trainer's and "
                "TRL's SFTTrainer's prediction steps are known to return; evaluate without sequence parallelism "
                "(sp_size 1) or use the Trainer's / SFTTrainer's prediction_step"
            )
        self.prediction_step = functools.partial(sequence_parallel_prediction_step, self, own_step)
        try:
            return original(self, *args, **kwargs)
        finally:
            del self.prediction_step

    return evaluation_loop
