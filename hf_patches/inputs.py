"""Model-level input check of a UPipe-patched model, run as a forward pre-hook on the base model.

Every rank of the sequence group exchanges a few numbers about its inputs and its UPipe settings
(``UPipeRuntime.settings``, checked by ``ds_upipe.validation.check_settings`` as the core layer's
are) and then the global position_ids and attention mask (two small all_gathers), so all ranks
evaluate the same rules on the same data and raise the same ValueError (no rank is left waiting in
a collective).  The global last position then sets the
RoPE frequencies of the whole sequence (``hf_patches.rope``).

What we can honour: each rank holds a contiguous, equally long shard of the sequence (ALST's
convention; with a ring group, its zigzag shard: ``ds_upipe.ring.zigzag_positions``), with
position_ids = the global positions of its tokens once the shards are put back in sequence order;
attention_mask None or a 2-D right-padding mask (ones, then zeros: with causal attention, real tokens
never see the padding, so their outputs are exact; the padding's outputs are unspecified and must
carry ignored labels).  Packed sequences: where the global positions are not consecutive (a
restart), a new document begins (transformers' ``find_packed_sequence_indices`` rule), and every
attention layer of the forward attends within documents only (the boundaries travel with the
forward's keyword arguments, ``hf_patches.state.DOCUMENTS_KWARG``; ``ds_upipe.packing``); not with
a ring group.  Anything else (left padding, 4-D masks, a KV cache)
is refused.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_upipe.packing import DocumentBoundaries, documents_from_positions
from ds_upipe.ring import zigzag_unshard
from ds_upipe.validation import RuntimeSettings, check_settings

from .rope import set_last_position
from .state import DOCUMENTS_KWARG, EXCHANGED_KV_KWARG, ExchangedKeyValues, UPipeState

_MASK_NONE, _MASK_2D, _MASK_OTHER = 0, 1, 2
logger = logging.getLogger("hf_patches")

#: flash-attn packing kwargs (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): they
#: describe the whole row, and UPipe derives the same boundaries from the global position_ids
_FLASH_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

#: why a patched model cannot generate, and what to do instead (also used by the input check)
GENERATION_UNSUPPORTED = (
    "generation (KV cache / incremental decoding) is not supported under UPipe sequence parallelism: a model "
    "patched by hf_patches.apply_upipe runs training forward/backward on a sequence sharded over its group's "
    "ranks. Generate without sequence parallelism, on a model with the same weights that apply_upipe has not "
    "patched: e.g. save_pretrained(path), then from_pretrained(path, attn_implementation='sdpa') (a copy.deepcopy "
    "of a patched model is patched too)"
)


def _gather(t: Tensor, group: dist.ProcessGroup | None, group_size: int) -> list[Tensor]:
    if group_size == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(group_size)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def gather_over_sequence_group(t: Tensor, state: UPipeState) -> list[Tensor]:
    """Every rank's ``t`` in sequence-parallel rank order (ring index major): over the Ulysses group,
    then, with a ring, the Ulysses groups' rows over the ring group."""
    rows = _gather(t, state.group, state.group_size)
    if state.ring_size == 1:
        return rows
    rings = _gather(torch.stack(rows), state.ring_group, state.ring_size)
    return [row for ring in rings for row in ring.unbind(0)]


def global_sequence(t: Tensor, state: UPipeState) -> Tensor:
    """A [..., local_seq] tensor of every rank, gathered and put back in sequence order ([..., S])."""
    return zigzag_unshard(gather_over_sequence_group(t, state), t.dim() - 1, state.layout)


def _as_kwargs(forward: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [
        p.name
        for p in inspect.signature(forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(args) > len(names):
        raise TypeError(f"too many positional arguments for {forward}")
    return {**dict(zip(names, args)), **kwargs}


def check_and_prepare(model: nn.Module, args: tuple, kwargs: dict, state: UPipeState) -> tuple[tuple, dict]:
    """Validate one forward call's inputs on all ranks; return (args, kwargs) to run it with."""
    call = _as_kwargs(model.forward, args, kwargs)
    tokens = call.get("input_ids")
    if tokens is None:
        tokens = call.get("inputs_embeds")
    if tokens is None:
        raise ValueError("pass input_ids or inputs_embeds")
    batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
    device = tokens.device
    position_ids = call.get("position_ids")
    mask = call.get("attention_mask")
    cache = call.get("cache", call.get("past_key_values"))
    if mask is None:
        mask_kind = _MASK_NONE
    elif isinstance(mask, Tensor) and mask.dim() == 2 and tuple(mask.shape) == (batch, seq):
        mask_kind = _MASK_2D
    else:
        mask_kind = _MASK_OTHER
    pos_batch, text_positions = -1, position_ids
    if position_ids is not None:
        text_positions, pos_batch = _text_positions(position_ids, seq)
    # the runtime's one record of what every rank must agree on (ds_upipe.validation.check_settings)
    settings = state.settings().encode()
    meta = torch.tensor(
        [batch, seq, pos_batch, mask_kind, int(cache is not None), int(bool(call.get("use_cache")))] + settings,
        dtype=torch.long,
        device=device,
    )
    rows = [m.tolist() for m in gather_over_sequence_group(meta, state)]
    check_settings([RuntimeSettings.decode(row[-len(settings) :]) for row in rows])
    _check_meta(rows)

    pos = text_positions.to(device=device, dtype=torch.long).expand(batch, seq)
    keep = torch.ones((batch, seq), dtype=torch.long, device=device) if mask is None else (mask != 0).long()
    full = global_sequence(torch.stack([pos, keep.to(device)]), state)  # [2, b, S] in sequence order
    _check_positions_and_mask(full[0], full[1], state.ring_size)
    documents = documents_from_positions(full[0], full[1])
    if documents is not None and state.kwargs_dropped_by is not None:  # the same gathered positions on every rank
        raise ValueError(
            f"packed documents (position_ids that restart inside a row) cannot reach the attention of "
            f"{state.kwargs_dropped_by}: its forward does not pass its **kwargs on, where UPipe threads the documents' "
            "boundaries; pass one document per row (unpacked rows run exactly) or pad instead of packing"
        )
    if documents is not None:
        _warn_if_local_positions(documents, seq, state.layout.sp_size)
    set_last_position(model, full[0].max())  # RoPE scaling decided by the whole sequence, as unsharded

    for key in _FLASH_PACKING_KWARGS:
        call.pop(key, None)
    call["attention_mask"] = None  # honoured: right padding needs no mask under causal attention
    call["use_cache"] = False
    call[DOCUMENTS_KWARG] = documents  # this forward's, to its attention modules (and their replays)
    # this forward's producers' exchanged keys and values, for its KV-shared layers (ds_upipe.exchanged_kv)
    call[EXCHANGED_KV_KWARG] = ExchangedKeyValues() if state.options.share_exchanged_kv else None
    return (), call


#: ``_text_positions``' codes for position_ids UPipe cannot read (exchanged, so every rank raises alike)
_POS_MISSING, _POS_LENGTH, _POS_VISION, _POS_SHAPE = -1, -2, -3, -4


def _text_positions(position_ids: Tensor, seq: int) -> tuple[Tensor, int]:
    """(the text positions [b, s] of a forward's position_ids, their batch size or a ``_POS_*`` code).

    Multimodal RoPE (Qwen3.5, Qwen3-VL: ``mrope_section``) takes [3, b, s] (temporal, height, width) or
    [4, b, s] (transformers' text positions first, then the three): the text positions decide the global
    sequence and the packed documents, as transformers' own mask does.  A [3, b, s] whose rows differ holds
    vision positions without the text ones, which UPipe cannot recover."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    if position_ids.dim() == 3:
        if position_ids.shape[0] == 4:
            position_ids = position_ids[0]
        elif position_ids.shape[0] == 3 and bool((position_ids == position_ids[:1]).all()):
            position_ids = position_ids[0]  # text only: the three sections are the text positions
        else:
            return position_ids, _POS_VISION if position_ids.shape[0] == 3 else _POS_SHAPE
    if position_ids.dim() != 2:
        return position_ids, _POS_SHAPE
    return position_ids, int(position_ids.shape[0]) if position_ids.shape[-1] == seq else _POS_LENGTH


def _check_meta(rows: list[list[int]]) -> None:
    per_rank = lambda i: [r[i] for r in rows]  # noqa: E731
    if any(per_rank(4)):
        raise ValueError(
            f"a KV cache was passed (ranks {[r for r, v in enumerate(per_rank(4)) if v]}): {GENERATION_UNSUPPORTED}. "
            "For training, pass cache=None, use_cache=False"
        )
    if any(per_rank(5)):
        raise ValueError(f"use_cache=True: {GENERATION_UNSUPPORTED}. For training, pass use_cache=False")
    if any(k == _MASK_OTHER for k in per_rank(3)):
        raise ValueError(
            f"attention_mask kinds per rank {per_rank(3)} (2 = not a [batch, local_seq] 2-D mask): UPipe attention is "
            "causal over the whole sequence and can only honour None or a 2-D right-padding mask (for packed "
            "documents pass no mask and position_ids that restart at each document)"
        )
    if any(p == _POS_MISSING for p in per_rank(2)):
        missing = [r for r, p in enumerate(per_rank(2)) if p == _POS_MISSING]
        raise ValueError(
            f"position_ids are required on every sequence-parallel rank (missing on ranks {missing}): pass the global "
            "positions of each rank's shard, e.g. from hf_patches.shard_batch"
        )
    if len(set(per_rank(1))) != 1 or per_rank(1)[0] < 1:
        raise ValueError(
            f"local sequence lengths differ across ranks: {per_rank(1)}; every rank must hold an equal, non-empty "
            "shard (pad the sequence to a multiple of the sequence-parallel size, as hf_patches.shard_batch does)"
        )
    if len(set(per_rank(0))) != 1:
        raise ValueError(f"batch sizes differ across ranks: {per_rank(0)}")
    if any(p in (_POS_VISION, _POS_SHAPE) for p in per_rank(2)):
        raise ValueError(
            f"position_ids per rank {per_rank(2)} ({_POS_VISION}: [3, batch, local_seq] multimodal RoPE positions "
            f"whose rows differ, {_POS_SHAPE}: another shape): UPipe reads [batch, local_seq] text positions, or "
            "multimodal RoPE's [4, batch, local_seq] with the text positions first (transformers' convention) or "
            "[3, batch, local_seq] of text tokens (equal rows)"
        )
    if any(p == _POS_LENGTH for p in per_rank(2)) or any(p not in (1, per_rank(0)[0]) for p in per_rank(2)):
        raise ValueError(
            f"position_ids batch sizes per rank {per_rank(2)} ({_POS_LENGTH}: length differs from the input's) must be "
            "1 or the batch size, with one position per local token"
        )


def _check_positions_and_mask(pos: Tensor, keep: Tensor, ring_size: int = 1) -> None:
    """pos, keep: [b, S] global position_ids and 0/1 attention mask, in sequence order."""
    if keep.shape[1] > 1 and bool((keep[:, 1:] > keep[:, :-1]).any()):
        raise ValueError(
            "attention_mask has padding before real tokens (left padding or holes); UPipe attention is causal over the "
            "whole sequence and can only honour right padding (ones, then zeros). Pad at the end instead"
        )
    real_pairs = keep[:, 1:].bool()  # both tokens real (the mask is non-increasing)
    if ring_size > 1 and bool(((pos[:, 1:] - pos[:, :-1] != 1) & real_pairs).any()):
        raise ValueError(
            "position_ids are not consecutive over the whole sequence (in the ring's zigzag order, "
            f"ds_upipe.ring.zigzag_positions). Each rank must pass the global positions of its zigzag shard (ring "
            f"size {ring_size}), e.g. from hf_patches.shard_batch; packed sequences (positions that restart) are not "
            "supported with a ring group: use UPipe without ring_group for packed rows"
        )


#: a log line printed once per process (a logging decision, read by no computation)
_WARNED_LOCAL_POSITIONS: list[bool] = []


def _warn_if_local_positions(documents: DocumentBoundaries, local_seq: int, sp_size: int) -> None:
    """Documents starting exactly at every shard start and nowhere else look like each rank passing
    its local positions (0 ... s-1) instead of global ones: legal packing, but most likely a mistake."""
    shard_starts = tuple(range(0, local_seq * sp_size + 1, local_seq))
    if sp_size > 1 and not _WARNED_LOCAL_POSITIONS and all(row == shard_starts for row in documents.rows):
        _WARNED_LOCAL_POSITIONS.append(True)  # once per process
        logger.warning(
            "hf_patches: position_ids restart at every shard start and nowhere else, so every shard is run as its "
            "own document. If these are packed documents, ignore this; if each rank passed its local positions, "
            "pass the global ones instead (hf_patches.shard_batch)"
        )
