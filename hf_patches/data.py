"""Sequence sharding of batches for a UPipe-patched model (ALST's input convention).

Each rank of the sequence-parallel group gets the contiguous shard ``rank`` of every sequence,
the matching global ``position_ids`` and pre-shifted labels (``shift_labels``: the label of the
next token, so the loss needs no token from another rank).  Sequences are padded at the end to a
multiple of the group size; padded positions get label -100 (ignored) and, being at the end,
are never attended to by real tokens under causal attention.

``sequence_parallel_dataloader`` reuses DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (which
exchanges samples between ranks, shards them and creates ``shift_labels``) after a padding step
it lacks; ``shard_batch`` does the same for one batch that every rank already holds.

UPipe x Ring (``ring_size`` R > 1; ``group`` is then the whole sequence-parallel group of C_u x R
ranks): each rank gets its zigzag shard instead (``ds_upipe.ring.zigzag_positions``: ring rank i
holds chunks i and 2R-1-i of 2R, split over its Ulysses ranks), sequences are padded to a multiple
of R x lcm(2, C_u), and ``shift_labels`` are shifted in sequence order before sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ds_upipe.ring import SequenceLayout, sequence_layout, zigzag_positions, zigzag_unshard

IGNORE_INDEX = -100


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _layout(group: dist.ProcessGroup | None, ring_size: int) -> tuple[int, SequenceLayout]:
    """(this rank's sequence-parallel rank, the C_u x R layout of ``group``)."""
    rank, size = _group_info(group)
    return rank, sequence_layout(size, ring_size)


def _sequence_tensors(batch: dict[str, Any], seq: int) -> list[str]:
    return [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 2 and v.shape[1] == seq]


#: the tensors of a vision-language batch that do not run along the sequence (images, videos, their grids and
#: sizes): never padded; the model computes its own positions (mrope) from the whole sample
VISION_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "image_sizes")


def pad_batch(
    batch: dict[str, Any],
    multiple: int,
    *,
    pad_token_id: int = 0,
    length: int | None = None,
    vision_language: bool = False,
) -> dict[str, Any]:
    """Pad a [batch, seq] batch at the end to a multiple of ``multiple`` (at least ``length`` tokens
    when given) and add ``position_ids``.

    input_ids get ``pad_token_id``, labels -100, attention_mask 0, position_ids keep counting;
    any other [batch, seq, ...] tensor gets zeros.  Labels under attention_mask == 0 become -100.
    A mask with padding before real tokens (left padding) is refused: UPipe cannot honour it.
    ``vision_language``: a whole vision-language sample: ``VISION_INPUTS`` are left alone and no
    position_ids are added (the model derives them from the whole sample)."""
    if "input_ids" not in batch:
        raise ValueError(f"the batch needs input_ids (got keys {sorted(batch)})")
    input_ids = batch["input_ids"]
    b, seq = input_ids.shape[:2]
    out = dict(batch)
    mask = batch.get("attention_mask")
    if mask is not None:
        if mask.dim() != 2 or tuple(mask.shape) != (b, seq):
            raise ValueError(f"attention_mask must be [batch, seq] = {(b, seq)}, got {tuple(mask.shape)}")
        if seq > 1 and bool(((mask[:, 1:] != 0) & (mask[:, :-1] == 0)).any()):
            raise ValueError("attention_mask has padding before real tokens (left padding); pad at the end instead")
        if "labels" in batch:
            out["labels"] = batch["labels"].masked_fill(mask == 0, IGNORE_INDEX)
    if out.get("position_ids") is None and not vision_language:
        out["position_ids"] = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(b, seq).contiguous()
    pad = (-seq) % multiple
    if length is not None:
        pad = max(pad, length - seq)
    if pad == 0:
        return out
    fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0}
    for key, value in out.items():
        if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != seq:
            continue
        if vision_language and key in VISION_INPUTS:
            continue
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, pad + 1, device=value.device)
        else:
            tail = torch.full(
                (value.shape[0], pad, *value.shape[2:]), fill.get(key, 0), dtype=value.dtype, device=value.device
            )
        out[key] = torch.cat([value, tail], dim=1)
    return out


def shift_labels(labels: Tensor) -> Tensor:
    """labels[:, t + 1] at position t, -100 at the end (what a causal-LM loss compares logits[:, t] with)."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:].contiguous()


def shard_batch(
    batch: dict[str, Any], group: dist.ProcessGroup | None, *, pad_token_id: int = 0, ring_size: int = 1
) -> dict[str, Any]:
    """This rank's shard of a batch that every rank of ``group`` holds in full.

    Returns input_ids, position_ids (global), shift_labels (when the batch has labels; ``labels``
    itself is dropped, as in ALST), attention_mask (when given) and any other [batch, seq, ...]
    tensor, all sliced to this rank's contiguous shard after padding to a multiple of the group size.
    With ``ring_size`` R > 1, ``group`` is the whole sequence-parallel group (C_u x R ranks) and the
    shard is this rank's zigzag shard (module docstring).
    """
    rank, layout = _layout(group, ring_size)
    out = _with_shift_labels(dict(batch))
    out = pad_batch(out, layout.sequence_multiple, pad_token_id=pad_token_id)
    seq = out["input_ids"].shape[1]
    positions = zigzag_positions(seq, layout, rank).to(out["input_ids"].device)
    for key in _sequence_tensors(out, seq):
        out[key] = out[key].index_select(1, positions.to(out[key].device))
    return out


def _with_shift_labels(batch: dict[str, Any]) -> dict[str, Any]:
    """``labels`` replaced by ``shift_labels`` (padding under the attention mask ignored)."""
    if "labels" in batch:
        labels = batch.pop("labels")
        if batch.get("attention_mask") is not None:
            labels = labels.masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)
        batch["shift_labels"] = shift_labels(labels)
    return batch


def gather_sequence(shard: Tensor, group: dist.ProcessGroup | None, dim: int = 1, *, ring_size: int = 1) -> Tensor:
    """The whole sequence from every rank's shard along ``dim``, in sequence order (zigzag shards put
    back with ``ring_size`` > 1; not differentiable; for evaluation and tests)."""
    _, layout = _layout(group, ring_size)
    if layout.sp_size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(layout.sp_size)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return zigzag_unshard(parts, dim % shard.dim(), layout)


#: TRL's padding-free / packing collators add the varlen boundaries of the whole (unsharded) row for the
#: flash-attention and linear-attention kernels.  A rank's shard cannot use them (DeepSpeed's adapter
#: would slice seq_idx and pass cu_seq_lens unsliced), and they say nothing the global position_ids do
#: not: UPipe derives each row's documents from those (ds_upipe.packing), so they are dropped.
VARLEN_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def without_varlen_keys(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` without TRL's varlen keys (``VARLEN_KEYS``)."""
    return {k: v for k, v in batch.items() if k not in VARLEN_KEYS}


@dataclass(frozen=True)
class SourceBatch:
    """One rank's batch as its data loader gave it, before ds_upipe padded and sharded it: what the run
    without sequence parallelism sees, so the per-batch counts a trainer logs (tokens, FLOPs) come from
    it rather than from the padded shards."""

    #: rows holding the dataset's samples: the loader's repeated samples that even out its last round
    #: (accelerate's even_batches) are not counted, their labels ignored (``_CheckedLoader``)
    rows: int
    #: the collated length (before ds_upipe's padding to the group's longest and to a multiple); in a
    #: padding-free row of several samples, up to the first repeated one
    length: int
    #: attention_mask.sum() over those rows; rows x length for a batch without a mask
    tokens: int
    has_attention_mask: bool


class ShardedBatch(dict):
    """One micro-batch of a sequence-parallel loader: a dict of this rank's shard (what the model takes),
    with the ``SourceBatch`` it was cut from (every rank of the group holds the same one).  A dict
    subclass so that the record travels with the batch through the training loop, and a copy made by
    ``type(batch)(...)`` (the Trainer's ``_prepare_inputs``) is a plain shard without it."""

    source: SourceBatch | None = None

    def __init__(self, *args: Any, source: SourceBatch | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = source


#: a loader's rule for the batch it just gave: (samples per batch, how many of them, from the first,
#: are the dataset's; the rest repeat samples to even out the loader's last round)
DatasetSamples = Callable[[], tuple[int, int]]


def _without_repeated_samples(batch: dict[str, Any], per_batch: int, kept: int) -> tuple[dict[str, Any], int, int]:
    """(``batch`` with the labels of its samples from ``kept`` on ignored, its dataset rows, their
    length).  A sample is a row, or, in a padding-free row of ``per_batch`` samples end to end, a
    document (its ``position_ids`` restart at 0)."""
    rows, length = batch["input_ids"].shape[:2]
    if kept == per_batch:
        return batch, rows, length
    labels = batch["labels"].clone()
    if rows == per_batch:
        labels[kept:] = IGNORE_INDEX
        return {**batch, "labels": labels}, kept, length
    positions = batch.get("position_ids")
    if rows != 1 or positions is None:
        raise ValueError(
            f"the data loader repeats samples {kept}..{per_batch - 1} of its last batch to even out its last round, "
            f"and a batch of {rows} rows for {per_batch} samples without position_ids does not say which rows hold "
            "them; use drop_last=True (TrainingArguments.dataloader_drop_last), or one sample per row, or a "
            "padding-free row with position_ids restarting at each sample"
        )
    starts = (positions[0] == 0).nonzero().flatten().tolist()
    cut = starts[kept] if kept < len(starts) else length
    labels[:, cut:] = IGNORE_INDEX
    return {**batch, "labels": labels}, int(kept > 0), cut


#: keys DeepSpeed's UlyssesSPDataLoaderAdapter needs in every batch (position_ids: pad_batch adds them)
_REQUIRED_KEYS = ("input_ids", "labels")
_OK, _EXHAUSTED, _FAILED = 0, 1, 2
_PAD_ADVICE = (
    "Pad every sample to one length L (labels -100 at the padding): in the dataset, or with a collate_fn such as "
    "transformers' DataCollatorForSeq2Seq(tokenizer, padding='max_length', max_length=L), or, with one sample "
    "per batch, collate_fn=lambda samples: hf_patches.pad_batch(default_collate(samples), L)"
)


class _CheckedLoader:
    """Wraps a DataLoader (or any re-iterable of dict batches) with ``pad_batch``, and checks that the
    ranks' batches can go through ``UlyssesSPDataLoaderAdapter``.

    The adapter all_gathers every rank's batch over the group, so a rank whose batch is unusable
    (or that has run out of batches) would leave the others blocked or fail inside a collective with
    an error that names none of the data.  Each batch's status, keys, batch size and length are
    exchanged first (one tiny all_gather), and every rank raises the same ValueError on the same
    gathered data.  Rows of different lengths on different ranks (dynamic padding, TRL's default)
    are padded to the group's longest, so the adapter's all_gather gets one size on every rank (gloo
    requires it); TRL's varlen keys are dropped (``VARLEN_KEYS``).

    The same exchange tells every rank each rank's ``SourceBatch`` (``round_sources``, in rank order:
    the order of the adapter's micro-batches).  ``dataset_samples`` (the loader's rule, e.g. accelerate's
    even_batches: ``trainer_sp.accelerate_dataset_samples``) marks a last round's repeated samples, whose
    labels are then ignored, so they add nothing to a loss, a gradient or a metric."""

    def __init__(
        self,
        loader: Iterable[dict[str, Any]],
        group: dist.ProcessGroup,
        device: torch.device | str,
        pad_token_id: int,
        layout: SequenceLayout,
        dataset_samples: DatasetSamples | None = None,
        vision_language: bool = False,
    ) -> None:
        self.loader, self.group, self.device, self.pad_token_id = loader, group, torch.device(device), pad_token_id
        #: whole vision-language samples (``whole_sample_round``): padded to a multiple only, images left alone
        self.vision_language = vision_language
        self.layout = layout
        self.multiple = layout.sequence_multiple
        self.dataset_samples = dataset_samples
        #: its batches come in zigzag order already (an adapter around it must not reorder them again)
        self.zigzag_ordered = layout.ring_size > 1
        #: the source batches of the last round, one per rank of the group
        self.round_sources: list[SourceBatch] = []

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = iter(self.loader)
        while True:
            batch, length, status, error, source = None, -1, _OK, None, []
            try:
                batch = next(batches)
                if _has_required_keys(batch):
                    length = batch["input_ids"].shape[1]
                    batch, source = self._source(without_varlen_keys(batch))
                    batch = self._pad(batch)
            except StopIteration:
                status = _EXHAUSTED
            except Exception as err:  # noqa: BLE001 - reported on every rank by _check_group
                status, error = _FAILED, err
            row = _describe_batch(batch, length, status) + (source or [-1] * 4)
            longest = self._check_group(batch, row, error)
            if status == _EXHAUSTED:
                return
            if not self.vision_language:  # whole samples are exchanged as they are: no common length needed
                batch = self._pad(batch, longest)
            yield batch if self.layout.ring_size == 1 else _in_zigzag_order(batch, self.layout)

    def _pad(self, batch: dict[str, Any], length: int | None = None) -> dict[str, Any]:
        return pad_batch(
            batch, self.multiple, pad_token_id=self.pad_token_id, length=length, vision_language=self.vision_language
        )

    def _source(self, batch: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """(the batch with the labels of the loader's repeated samples ignored, [its dataset rows, their
        length, their tokens, has an attention mask]) before ds_upipe's padding."""
        rows, length = batch["input_ids"].shape[:2]
        if self.dataset_samples is not None:
            batch, rows, length = _without_repeated_samples(batch, *self.dataset_samples())
        mask = batch.get("attention_mask")
        tokens = rows * length if mask is None else int(mask[:rows].sum())
        return batch, [rows, length, tokens, int(mask is not None)]

    def _check_group(self, batch: Any, row: list[int], error: Exception | None) -> int:
        """The same ValueError on every rank unless all ranks' batches (rows: status, has input_ids,
        has labels, length, batch size, padded length, then the source's dataset rows, length, tokens
        and mask flag) can be gathered and sharded together; returns the group's longest padded length (-1 once
        the loaders are exhausted) and keeps the ranks' ``SourceBatch`` in ``round_sources``."""
        _, size = _group_info(self.group)
        mine = torch.tensor(row, dtype=torch.long, device=self.device)
        rows = [mine]
        if size > 1:
            rows = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(rows, mine, group=self.group)
        rows = [r.tolist() for r in rows]
        statuses = [r[0] for r in rows]
        if _FAILED in statuses:
            problems = self._gather_objects("" if error is None else f"{type(error).__name__}: {error}")
            raise ValueError(
                "could not build this step's batches on every rank of the sequence-parallel group ("
                + "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
                + "). If the samples have different lengths, a batch cannot be stacked: "
                + _PAD_ADVICE
            ) from error
        if _EXHAUSTED in statuses:
            if len(set(statuses)) != 1:
                ran_out = [r for r, s in enumerate(statuses) if s == _EXHAUSTED]
                raise ValueError(
                    f"ranks {ran_out} of the sequence-parallel group ran out of batches before the others: the "
                    "group trains its ranks' batches together, so every rank's loader must give the same number of "
                    "batches (equal dataset shards, drop_last=True)"
                )
            return -1
        if not all(all(r[1 : 1 + len(_REQUIRED_KEYS)]) for r in rows):
            keys = self._gather_objects(sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__)
            raise ValueError(
                f"every training batch must be a dict (mapping) with {' and '.join(_REQUIRED_KEYS)} "
                "(labels: the token ids to predict, usually a copy of input_ids, -100 where no loss is wanted); "
                "got keys " + "; ".join(f"rank {r}: {k}" for r, k in enumerate(keys))
            )
        batch_sizes = [r[4] for r in rows]
        if len(set(batch_sizes)) != 1:
            raise ValueError(
                f"the ranks' batches have different batch sizes ({_per_rank(batch_sizes)}): the sequence-parallel "
                "group trains them together; use the same batch size on every rank and drop_last=True"
            )
        self.round_sources = [SourceBatch(r[6], r[7], r[8], bool(r[9])) for r in rows]
        return max(r[5] for r in rows)

    def _gather_objects(self, mine: Any) -> list[Any]:
        _, size = _group_info(self.group)
        if size == 1:
            return [mine]
        everyone: list[Any] = [None] * size
        dist.all_gather_object(everyone, mine, group=self.group)
        return everyone


def _has_required_keys(batch: Any) -> bool:
    return isinstance(batch, Mapping) and all(k in batch for k in _REQUIRED_KEYS)


def _describe_batch(batch: Any, length: int, status: int) -> list[int]:
    has = [int(isinstance(batch, Mapping) and k in batch) for k in _REQUIRED_KEYS]
    if status != _OK or not all(has):
        return [status, *has, -1, -1, -1]
    return [status, *has, length, *batch["input_ids"].shape[:2]]


def _per_rank(values: list[Any]) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


#: where the zigzag-ordered batch carries its shift_labels through UlyssesSPDataLoaderAdapter, which
#: would compute them from ``labels`` in the (reordered) order it is given
_ZIGZAG_SHIFT_LABELS = "_upipe_zigzag_shift_labels"


def _in_zigzag_order(batch: dict[str, Any], layout: SequenceLayout) -> dict[str, Any]:
    """A padded batch with its sequence reordered so that contiguous shards are the zigzag shards
    (every rank's ``zigzag_positions`` concatenated in rank order), shift_labels computed before."""
    out = dict(batch)
    labels = out["labels"]
    if out.get("attention_mask") is not None:
        labels = labels.masked_fill(out["attention_mask"] == 0, IGNORE_INDEX)
    out[_ZIGZAG_SHIFT_LABELS] = shift_labels(labels)
    seq = out["input_ids"].shape[1]
    order = torch.cat([zigzag_positions(seq, layout, r) for r in range(layout.sp_size)])
    for key in _sequence_tensors(out, seq):
        out[key] = out[key].index_select(1, order.to(out[key].device))
    return out


def use_zigzag_shift_labels(micro_batch: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch of ``UlyssesSPDataLoaderAdapter`` over ``zigzag_ordered`` batches, with the
    shift_labels shifted in sequence order (in place)."""
    micro_batch["shift_labels"] = micro_batch.pop(_ZIGZAG_SHIFT_LABELS)
    return micro_batch


class _ZigzagShards:
    """The adapter's micro-batches with the shift_labels of ``_in_zigzag_order``."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    def __len__(self) -> int:
        return len(self.adapter)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.adapter:
            yield use_zigzag_shift_labels(batch)


def collective_device(backend: str, device: torch.device | str | None = None) -> torch.device:
    """The device the loader's batches go to and are all_gathered on, for a group of this backend
    (``dist.get_backend``: "nccl", "gloo", or "cpu:gloo,cuda:nccl" for a group with both): None
    picks the current CUDA device for an NCCL-only group and the CPU otherwise.  An NCCL-only group
    cannot all_gather CPU tensors (nor a gloo-only one CUDA tensors): ValueError naming both."""
    parts = {p.split(":")[-1] for p in backend.split(",")}
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if parts == {"nccl"} else torch.device("cpu")
    device = torch.device(device)
    needs = {"cpu": "gloo", "cuda": "nccl"}.get(device.type)
    if needs is not None and needs not in parts:
        raise ValueError(
            f"device={str(device)!r}: the sequence-parallel group's backend {backend!r} cannot all_gather "
            f"{device.type} tensors (that needs {needs}); pass device=None for the group's own device"
        )
    return device


def sequence_parallel_dataloader(
    loader: Iterable[dict[str, Any]],
    group: dist.ProcessGroup,
    *,
    device: torch.device | str | None = None,
    pad_token_id: int = 0,
    ring_size: int = 1,
    dataset_samples: DatasetSamples | None = None,
    vision_language: bool = False,
) -> Any:
    """Wrap a per-rank DataLoader for UPipe: pad to a multiple of the group size, then DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` (needs ``deepspeed.comm`` initialized, e.g. by
    ``deepspeed.init_distributed``).  Each yielded micro-batch is one rank's shard with
    input_ids, position_ids and shift_labels; the group processes the ranks' samples in turn.
    With ``ring_size`` R > 1 (``group``: the whole C_u x R sequence-parallel group) each rank's
    shard is its zigzag shard (module docstring).

    Batches must be dicts with input_ids and labels ([batch, seq]).  A batch that cannot be built,
    lacks those keys or differs in batch size from the other ranks' raises the same ValueError on
    every rank; one shorter than another rank's is padded to the longer (``_CheckedLoader``).

    ``device``: where the batches go and are gathered; None (the default) is the group's own device
    (``collective_device``: the current CUDA device on NCCL, the CPU on gloo).  ``dataset_samples``:
    the loader's rule for the samples that pad its last round (their labels are ignored; ``_CheckedLoader``).
    ``vision_language``: a model patched by ``hf_patches.vlm`` (``WholeSamples``: every rank gets the
    whole sample and its shard of the shifted labels)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    device = collective_device(dist.get_backend(group) if dist.is_initialized() else "gloo", device)
    rank, layout = _layout(group, ring_size)
    checked = checked_loader(
        loader,
        group,
        device,
        pad_token_id=pad_token_id,
        ring_size=ring_size,
        dataset_samples=dataset_samples,
        vision_language=vision_language,
    )
    if vision_language:
        return WholeSamples(checked, group, device)
    adapter = UlyssesSPDataLoaderAdapter(checked, rank, group, layout.sp_size, device)
    return adapter if ring_size == 1 else _ZigzagShards(adapter)


def checked_loader(
    loader: Iterable[dict[str, Any]],
    group: dist.ProcessGroup,
    device: torch.device | str,
    *,
    pad_token_id: int = 0,
    ring_size: int = 1,
    dataset_samples: DatasetSamples | None = None,
    vision_language: bool = False,
) -> Any:
    """``loader`` made ready for ``UlyssesSPDataLoaderAdapter`` (``_CheckedLoader``: the ranks'
    batches checked together, padded to one length, TRL's varlen keys dropped; in zigzag order with
    ``ring_size`` > 1, then ``use_zigzag_shift_labels`` on each micro-batch).  ``dataset_samples``: the
    loader's rule for its repeated samples (``_CheckedLoader``).  Already checked: as is."""
    if isinstance(loader, _CheckedLoader):
        return loader
    layout = _layout(group, ring_size)[1]
    if vision_language and ring_size > 1:
        raise ValueError(
            f"a vision-language model with ring_size={ring_size}: not supported (its merged sequence is cut into "
            "contiguous shards); run UPipe without a ring"
        )
    return _CheckedLoader(loader, group, torch.device(device), pad_token_id, layout, dataset_samples, vision_language)


def vision_language_micro_batch(batch: dict[str, Any], rank: int, size: int, device: torch.device) -> dict[str, Any]:
    """One rank's micro-batch of a whole vision-language batch: every tensor whole (the model shares out the
    images, merges and cuts the sequence itself: ``hf_patches.vlm``), ``labels`` replaced by this rank's
    contiguous shard of the shifted labels (what its logits are scored against: the model's loss, TRL's fused
    LM head and metrics, the trainers' token counts, as for a text shard)."""
    out = _with_shift_labels({k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()})
    seq = out["input_ids"].shape[1]
    mine = zigzag_positions(seq, sequence_layout(size, 1), rank).to(device)  # the contiguous shard
    out["shift_labels"] = out["shift_labels"].index_select(1, mine)
    return out


def whole_sample_round(
    batch: dict[str, Any], group: dist.ProcessGroup, device: torch.device, sources: list[SourceBatch]
) -> list[ShardedBatch]:
    """The micro-batches of one round of a vision-language loader: as DeepSpeed's adapter does for text, the
    group trains its ranks' batches in turn (rank order), each given whole to every rank
    (``vision_language_micro_batch``), with its ``SourceBatch``."""
    rank, size = _group_info(group)
    mine = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
    everyone: list[Any] = [mine]
    if size > 1:
        everyone = [None] * size
        dist.all_gather_object(everyone, mine, group=group)  # the batches' sizes differ (images, lengths)
    return [
        ShardedBatch(vision_language_micro_batch(b, rank, size, device), source=s)
        for b, s in zip(everyone, sources, strict=True)
    ]


class WholeSamples:
    """A checked vision-language loader's micro-batches under sequence parallelism (``whole_sample_round``):
    ``len(loader) x C`` micro-batches, as DeepSpeed's adapter gives for text."""

    def __init__(self, checked: Any, group: dist.ProcessGroup, device: torch.device | str) -> None:
        self.checked, self.group, self.device = checked, group, torch.device(device)

    def __len__(self) -> int:
        return len(self.checked) * _group_info(self.group)[1]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.checked:
            yield from whole_sample_round(batch, self.group, self.device, self.checked.round_sources)
