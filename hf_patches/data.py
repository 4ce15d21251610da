"""Sequence sharding of batches for a UPipe-patched model (ALST's input convention).

Each rank of the sequence-parallel group gets the contiguous shard ``rank`` of every sequence,
the matching global ``position_ids`` and pre-shifted labels (``shift_labels``: the label of the
next token, so the loss needs no token from another rank).  Sequences are padded at the end to a
multiple of the group size; padded positions get label -100 (ignored) and, being at the end,
are never attended to by real tokens under causal attention.

``sequence_parallel_dataloader`` reuses DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (which
exchanges samples between ranks, shards them and creates ``shift_labels``) after a padding step
it lacks; ``shard_batch`` does the same for one batch that every rank already holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

IGNORE_INDEX = -100


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def pad_batch(batch: dict[str, Any], multiple: int, *, pad_token_id: int = 0) -> dict[str, Any]:
    """Pad a [batch, seq] batch at the end to a multiple of ``multiple`` and add ``position_ids``.

    input_ids get ``pad_token_id``, labels -100, attention_mask 0, position_ids keep counting;
    any other [batch, seq, ...] tensor gets zeros.  Labels under attention_mask == 0 become -100.
    A mask with padding before real tokens (left padding) is refused: UPipe cannot honour it."""
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
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(b, seq).contiguous()
    pad = (-seq) % multiple
    if pad == 0:
        return out
    fill = {"input_ids": pad_token_id, "labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0}
    for key, value in out.items():
        if not torch.is_tensor(value) or value.dim() < 2 or value.shape[1] != seq:
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


def shard_batch(batch: dict[str, Any], group: dist.ProcessGroup | None, *, pad_token_id: int = 0) -> dict[str, Any]:
    """This rank's shard of a batch that every rank of ``group`` holds in full.

    Returns input_ids, position_ids (global), shift_labels (when the batch has labels; ``labels``
    itself is dropped, as in ALST), attention_mask (when given) and any other [batch, seq, ...]
    tensor, all sliced to this rank's contiguous shard after padding to a multiple of the group size.
    """
    rank, size = _group_info(group)
    out = dict(batch)
    if "labels" in out:
        labels = out.pop("labels")
        if out.get("attention_mask") is not None:
            labels = labels.masked_fill(out["attention_mask"] == 0, IGNORE_INDEX)
        out["shift_labels"] = shift_labels(labels)
    out = pad_batch(out, size, pad_token_id=pad_token_id)
    seq = out["input_ids"].shape[1]
    chunk = seq // size
    for key, value in out.items():
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[1] == seq:
            out[key] = value[:, rank * chunk : (rank + 1) * chunk].contiguous()
    return out


def gather_sequence(shard: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """Concatenate every rank's shard along ``dim`` (not differentiable; for evaluation and tests)."""
    _, size = _group_info(group)
    if size == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _PaddedLoader:
    """Wraps a DataLoader (or any re-iterable of dict batches) with ``pad_batch``."""

    def __init__(self, loader: Iterable[dict[str, Any]], multiple: int, pad_token_id: int) -> None:
        self.loader, self.multiple, self.pad_token_id = loader, multiple, pad_token_id

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield pad_batch(dict(batch), self.multiple, pad_token_id=self.pad_token_id)


def sequence_parallel_dataloader(
    loader: Iterable[dict[str, Any]],
    group: dist.ProcessGroup,
    *,
    device: torch.device | str = "cpu",
    pad_token_id: int = 0,
) -> Any:
    """Wrap a per-rank DataLoader for UPipe: pad to a multiple of the group size, then DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` (needs ``deepspeed.comm`` initialized, e.g. by
    ``deepspeed.init_distributed``).  Each yielded micro-batch is one rank's shard with
    input_ids, position_ids and shift_labels; the group processes the ranks' samples in turn."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    rank, size = _group_info(group)
    return UlyssesSPDataLoaderAdapter(_PaddedLoader(loader, size, pad_token_id), rank, group, size, device)
