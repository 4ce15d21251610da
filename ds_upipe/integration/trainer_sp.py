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
- **The counts and metrics logged per batch.**  The Trainer (FLOPs, tokens seen) and TRL's SFTTrainer
  (``num_tokens``, ``entropy``, ``mean_token_accuracy``) count each micro-batch they are given: under SP a
  padded shard.  Each micro-batch carries its source batch (``hf_patches.data.SourceBatch``, before
  ds_upipe's padding), the rows that accelerate repeats to even out a last round have their labels
  ignored at the source, and ``per_batch_metrics`` makes TRL's per-step values those of the source
  batches: the values the run without sequence parallelism logs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from hf_patches.data import IGNORE_INDEX, DatasetSamples, SourceBatch, sequence_parallel_dataloader
from hf_patches.logprobs import group_sum


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


def _sp_rank() -> int:
    from deepspeed.utils import groups

    return groups._get_sequence_parallel_rank()


def _labelled_tokens(inputs: dict[str, Any]) -> torch.Tensor:
    return (inputs["shift_labels"] != IGNORE_INDEX).sum()


def _shard_sums(
    loss: torch.Tensor, tokens: torch.Tensor, group: Any, differentiable: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sum over the group's ranks of each rank's token sum of the loss, the group's labelled
    tokens): a rank's token sum is its token mean x its labelled tokens; a shard without labelled
    tokens adds 0, also where its mean is NaN.  Summed by all_reduce (``group_sum``: differentiable,
    its backward the ranks' gradients summed): torch.distributed.nn's all_gather backward on gloo
    scatters from the group's ranks taken as global ranks, so it fails in any group without global rank 0
    (the sequence-parallel groups of DP > 1)."""
    mine = torch.where(tokens > 0, loss * tokens.to(loss.dtype), torch.zeros_like(loss))
    counts = tokens.clone()
    dist.all_reduce(counts, group=group)
    if differentiable:
        return group_sum(mine, group), counts
    total = mine.detach().clone()
    dist.all_reduce(total, group=group)
    return total, counts


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
# what is logged per batch: counted on the source batches


def accelerate_dataset_samples(loader: Any) -> DatasetSamples | None:
    """The rule for how many samples of the batch accelerate's per-process loader just gave are the
    dataset's; None for other loaders (nothing repeated, or nothing known).

    With ``even_batches`` (accelerate's default) a ``DataLoaderShard`` completes its last round with
    samples from the dataset's start, so that every process gets a full batch: of that round's samples,
    in process order, the first ``remainder`` are the dataset's (what ``gather_for_metrics`` keeps of
    per-sample values).  Under SP a sample's tokens are spread over the group, so the samples themselves
    are marked: their labels are ignored at the source (``hf_patches.data._CheckedLoader``)."""
    from accelerate.data_loader import DataLoaderShard
    from accelerate.state import PartialState

    if not isinstance(loader, DataLoaderShard):
        return None
    state = PartialState()
    per_batch = loader.total_batch_size // state.num_processes

    def dataset_samples() -> tuple[int, int]:
        if not loader.end_of_dataloader or loader.remainder <= 0:
            return per_batch, per_batch
        return per_batch, max(0, min(per_batch, loader.remainder - state.process_index * per_batch))

    return dataset_samples


def _trl_token_count(source: SourceBatch) -> int:
    """TRL's SFTTrainer count of a batch's tokens (``num_tokens``: ``attention_mask.sum()``, else
    ``position_ids.size(1)``), taken on the source batch; a batch of repeated samples counts nothing."""
    if source.rows == 0:
        return 0
    return source.tokens if source.has_attention_mask else source.length


def _gather_every_rank(accelerator: Any) -> Callable[..., Any]:
    from accelerate.utils import gather_object

    def gather_for_metrics(input_data: Any, use_gather_object: bool = False) -> Any:
        return gather_object(input_data) if use_gather_object else accelerator.gather(input_data)

    return gather_for_metrics


@contextlib.contextmanager
def per_batch_metrics(trainer: Any, source: SourceBatch, training: bool) -> Iterator[None]:
    """Around one micro-step of a trainer under SP (training or evaluation): the values TRL's SFTTrainer
    logs for the micro-batch are made those of its source batch.  TRL computes them inline in
    ``compute_loss`` from the inputs it is given (there is no hook), so:

    - ``gather_for_metrics`` keeps every rank's value in the step: accelerate drops a last round's
      values past the dataset's end one per *sample*, but TRL gathers one value per *rank* (the shard
      sums of one source batch), so that would drop shards; the repeated rows add nothing anyway (their
      labels are ignored at the source);
    - a micro-step on which no group had a dataset row (only repeated rows: no batch of the run without
      SP) leaves no entry in TRL's metric lists;
    - ``num_tokens``: TRL counted the shards' tokens, ds_upipe's padding included; the count is that of
      the source batches (each group's once)."""
    accelerator = trainer.accelerator
    lists = getattr(trainer, "_metrics", None)  # TRL's per-step metric lists, by mode
    # from the caller: a training step after an evaluation starts with the model still in eval mode
    mode = "train" if training else "eval"
    lengths = {k: len(v) for k, v in lists[mode].items()} if lists is not None else {}
    counted = getattr(trainer, "_total_train_tokens", None)
    accelerator.gather_for_metrics = _gather_every_rank(accelerator)
    try:
        yield
    finally:
        del accelerator.gather_for_metrics
    if lists is None:
        return
    mine = [source.rows, _trl_token_count(source)] if _sp_rank() == 0 else [0, 0]
    rows, tokens = accelerator.gather(torch.tensor([mine], device=accelerator.device)).sum(0).tolist()
    if rows == 0:
        for key, values in lists[mode].items():
            if key != "num_tokens":
                del values[lengths.get(key, 0) :]
    if mode == "train" and counted is not None:
        trainer._total_train_tokens = counted + tokens // getattr(trainer, "_tp_size", 1)
        lists[mode]["num_tokens"] = [trainer._total_train_tokens]


def _source(trainer: Any, inputs: Any) -> SourceBatch | None:
    """The source batch of a sequence-parallel micro-batch (``hf_patches.data.ShardedBatch``), else None."""
    source = getattr(inputs, "source", None)
    return source if source is not None and deepspeed_sp(trainer) is not None else None


def metrics_of_source(trainer: Any, inputs: Any, training: bool) -> contextlib.AbstractContextManager[None]:
    """``per_batch_metrics`` for a sequence-parallel micro-batch with its source batch; else nothing."""
    source = _source(trainer, inputs)
    return contextlib.nullcontext() if source is None else per_batch_metrics(trainer, source, training)


def wrap_training_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def training_step(self: Any, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        with metrics_of_source(self, inputs, training=True):
            return original(self, model, inputs, *args, **kwargs)

    return training_step


def wrap_floating_point_ops(original: Callable[..., Any]) -> Callable[..., Any]:
    """The Trainer's FLOP estimate (6 x parameters x input tokens, summed over every rank) of the source
    batch: each rank counts its share of the source's dataset rows at their collated length."""

    @functools.wraps(original)
    def floating_point_ops(self: Any, inputs: dict[str, Any]) -> Any:
        flops = original(self, inputs)
        source = _source(self, inputs)
        shard = inputs.get(getattr(self.model, "main_input_name", "input_ids"))
        if source is None or not torch.is_tensor(shard) or shard.numel() == 0:
            return flops
        return flops * source.rows * source.length / (shard.numel() * dist.get_world_size(_sp_group()))

    return floating_point_ops


def wrap_track_num_input_tokens(original: Callable[..., Any]) -> Callable[..., Any]:
    """The Trainer's ``num_input_tokens_seen`` counted on the source batches (``"all"``: the dataset rows
    at their collated length; ``"non_padding"``: their attention-mask tokens), each group's once."""

    @functools.wraps(original)
    def track_num_input_tokens(self: Any, inputs: dict[str, Any]) -> None:
        source = _source(self, inputs)
        how = self.args.include_num_input_tokens_seen
        if source is None or how == "no":
            return original(self, inputs)
        count = source.tokens if how == "non_padding" else source.rows * source.length
        mine = torch.as_tensor(count if _sp_rank() == 0 else 0, device=self.args.device, dtype=torch.int64)
        # the Trainer's own bookkeeping line, with the source's count
        self.state.num_input_tokens_seen += self.accelerator.gather(mine).sum().item()

    return track_num_input_tokens


# ---------------------------------------------------------------------------------------------------
# evaluation


class SequenceParallelEvalLoader:
    """A prepared eval DataLoader whose batches are sharded over the sequence group when iterated.

    The groups exist only once the model is prepared (``evaluate()`` may build the loader first), so
    sharding starts in ``__iter__``.  Each batch of each rank of a group is processed by the whole
    group in turn (ALST's ``UlyssesSPDataLoaderAdapter``); ``source_rank`` says whose batch the
    current micro-batch is."""

    def __init__(
        self,
        loader: Any,
        sequence_parallel_size: int,
        device: torch.device,
        ring_size: Callable[[Any], int],
        vision_language: Callable[[Any], bool],
    ) -> None:
        # ring_size, vision_language: of the sequence-parallel group, asked when iterating (the group's registration)
        self.loader, self.sp, self.device, self.ring_size = loader, sequence_parallel_size, device, ring_size
        self.vision_language = vision_language
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
        group = _sp_group()
        sharded = sequence_parallel_dataloader(
            self.loader,
            group,
            device=self.device,
            ring_size=self.ring_size(group),
            dataset_samples=accelerate_dataset_samples(self.loader),
            vision_language=self.vision_language(group),
        )
        self.own_loss = None
        for i, batch in enumerate(sharded):
            self.source_rank = i % self.sp
            yield batch
        self.source_rank = -1


def wrap_eval_loader(
    original: Callable[..., Any], ring_size: Callable[[Any], int], vision_language: Callable[[Any], bool]
) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_loader(self: Any, *args: Any, **kwargs: Any) -> Any:
        loader = original(self, *args, **kwargs)
        pc = deepspeed_sp(self)
        if pc is None or isinstance(loader, SequenceParallelEvalLoader):
            return loader
        return SequenceParallelEvalLoader(loader, pc.sp_size, self.args.device, ring_size, vision_language)

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
    metrics = metrics_of_source(trainer, inputs, training=False)
    inputs = {**inputs, "labels": inputs["shift_labels"]}
    with metrics:
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
