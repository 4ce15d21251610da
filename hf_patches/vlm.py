"""Vision-language models (``...ForConditionalGeneration``) under UPipe: images encoded once across the group,
the merged sequence sharded, positions of the whole sequence.

Every rank of the sequence-parallel group passes the FULL sample (``input_ids``, ``pixel_values``, the image
grids or sizes, ``labels``, ...), checked first (``check_same_sample``: one all_gather of a digest, the same
ValueError on every rank where a rank's sample differs, instead of ranks waiting in collectives sized by their
own images); the model's own forward then runs as without sequence parallelism, with three instance-level
changes (transformers has no hook between its merge and its text model):

- ``get_image_features`` / ``get_video_features`` of the inner model: each rank encodes only its share of
  the images (videos): contiguous blocks of whole images in sample order, rank r gets images
  ``[r * n // C, (r + 1) * n // C)`` (uneven shares differ by one image).  A rank whose share is empty
  (fewer images than ranks) encodes the first image and keeps none of its rows, so every rank runs the same
  modules (ZeRO-3 gathers the tower's parameters collectively) and its tower gradients are zeros.  The
  shares' features are gathered by ``ShareGather`` (an all-reduce of each rank's rows placed at their
  offsets; backward: the all-reduce of the gradient, this rank's rows), and returned per image as the
  original returns them (``pooler_output``; Qwen3-VL's ``deepstack_features`` too).
- a forward pre-hook on the text model, after the model's own merge and its position ids (mrope ``[3, B, S]``
  from the model's ``get_rope_index`` on the whole sequence; plain positions where the model passes none)
  are computed: ``inputs_embeds``, the positions (text positions prepended as transformers' ``[4, B, S]``
  convention, so UPipe's input check reads them), ``attention_mask`` and Qwen3-VL's deepstack rows are cut
  to this rank's contiguous shard.
- the causal LM's ``forward``: ``labels`` (the whole sample's) become this rank's shifted labels and the loss
  is ``sequence_parallel_loss`` of the shard's logits (the whole sample's token mean on every rank,
  gradients for a group that averages them, as DDP and ZeRO do); the logits are this rank's shard.

Gemma 3 (``IMAGE_SPANS``): its mask lets the tokens of one image see each other both ways (transformers'
``token_type_ids`` overlay, on full and sliding-window layers).  A forward pre-hook on the inner model turns the
whole sample's ``token_type_ids`` into the image spans with the model's own ``get_block_sequence_ids_for_mask``
(``ds_upipe.spans.BidirectionalSpans``) and passes them to the text model's forward as ``SPANS_KWARG``, which
transformers threads to every attention call (``ds_upipe.spans.SpanKernel``: exact).  The model's own per-layer
masks are None under UPipe's attention implementation (transformers has no mask function for it), so the whole
sample's 2-D ``attention_mask`` travels beside them (``_PADDING_KWARG``) to the shard hook, where UPipe's input
check reads it as for any VLM.  Gemma 4 (``ImageSpanRule``): the same, from ``mm_token_type_ids`` (images and
videos), on sliding-window layers only (``BidirectionalSpans.sliding_only``: its full layers are causal) and only
where ``use_bidirectional_attention == "vision"``; its per-layer inputs (``per_layer_inputs``, computed by the model
on the whole sample) are cut with the embeddings, its patch positions split with the pixels, its videos shared out
by whole video (``num_frames_per_video``); audio inputs refused by name.  LLaVA-OneVision: its pixels per image
(all of an image's anyres tiles on one rank, ``image_sizes`` with them), its per-sample image counts
(``batch_num_images``: which images are tiled) rewritten per share (``_share_sample_counts``).

Gradients: the text loss's gradient on a rank covers its tokens scaled by C (``loss.py``); the gathered
features' gradient summed over the group is the whole sample's gradient of the features, scaled by C, and each
rank keeps its own images' rows, so the tower's and projector's gradients averaged over the group are the
unsharded ones, as the text model's are.
"""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_upipe.spans import BidirectionalSpans
from ds_upipe.validation import mismatched_settings

from .data import IGNORE_INDEX, shift_labels
from .inputs import _as_kwargs, gather_over_sequence_group
from .loss import sequence_parallel_loss
from .state import SPANS_KWARG, UPipeState

#: model types whose attention mask is not causal over the image span in a way UPipe does not run (image tokens
#: attend to each other both ways: PaliGemma's bidirectional prefix, text included; Gemma 4 Unified's, not read
#: here): refused rather than run with another mask than the unsharded model's
NON_CAUSAL_IMAGE_MASKS = ("gemma4_unified", "paligemma")


@dataclass(frozen=True)
class ImageSpanRule:
    """How a model's mask lets its images attend to themselves both ways, run exactly with bidirectional spans
    (``ds_upipe.spans``)."""

    #: the inner model's argument that marks image tokens
    marks: str
    #: the function of the model's module that turns them into transformers' ``block_sequence_ids``
    block_ids: str
    #: the overlay is on sliding-window layers only (Gemma 4's ``create_masks_for_vision_model``)
    sliding_only: bool = False
    #: (text config attribute, value): the model overlays only where its text config has it (Gemma 4:
    #: ``use_bidirectional_attention == "vision"``; otherwise its mask is causal)
    switch: tuple[str, str] | None = None

    def on(self, config: Any) -> bool:
        return self.switch is None or getattr(config.get_text_config(), self.switch[0], None) == self.switch[1]


#: model types whose images attend to themselves both ways
IMAGE_SPANS = {
    "gemma3": ImageSpanRule("token_type_ids", "get_block_sequence_ids_for_mask"),
    "gemma4": ImageSpanRule(
        "mm_token_type_ids", "get_block_sequence_ids_for_mask", True, ("use_bidirectional_attention", "vision")
    ),
}
#: audio inputs of the forward (Gemma 4's ``input_features``): refused by name, the audio tower is not shared out
AUDIO_INPUTS = ("input_features", "input_features_mask")
#: the inner model's 2-D ``attention_mask``, carried by the image-span hook to the shard hook (see the docstring)
_PADDING_KWARG = "upipe_vlm_attention_mask"

#: the encoders of the inner model whose inputs are shared out by image (video)
ENCODERS = ("get_image_features", "get_video_features")
#: per-image arguments of the encoders, split with the images: grids (one row per image, its patches the
#: product of the row) and sizes
_GRIDS = ("image_grid_thw", "video_grid_thw")
#: per-video frame counts (Gemma 4: a video's pixel rows are its frames), shared out like a grid's rows
_FRAMES = "num_frames_per_video"
_PER_IMAGE = (*_GRIDS, "image_sizes", _FRAMES)
#: arguments with one entry per pixel row, split with the pixels (Gemma 4's patch positions: per image, per frame)
_PER_PIXEL_ROW = ("image_position_ids", "video_position_ids")
#: per-sample image counts (LLaVA-OneVision's): an image is tiled (anyres) only where its sample has one image, so a
#: share gets counts of its own (``_share_sample_counts``)
_SAMPLE_IMAGES = "batch_num_images"

#: the forward's whole-sample arguments, the same on every rank of the group (``check_same_sample``): the tower's
#: collectives are sized by the images, the text model's by the length
SAMPLE_ARGUMENTS = (
    "input_ids",
    "inputs_embeds",
    "attention_mask",
    "position_ids",
    "labels",
    "mm_token_type_ids",
    "token_type_ids",  # Gemma 3's image spans (``IMAGE_SPANS``)
    "pixel_values",
    "image_grid_thw",
    "image_sizes",
    _SAMPLE_IMAGES,
    "pixel_values_videos",
    "video_grid_thw",
    _FRAMES,
    "input_features",  # refused, after the check (``AUDIO_INPUTS``)
    "shift_labels",
)
#: of them, each rank's own shard (compared by shape only): ``shift_labels``, and ``labels`` beside them (the
#: Trainer / TRL routes pass the shard as both: ``trainer_sp.sequence_parallel_loss``)
_SHARDS = ("shift_labels", "labels")
#: dims of an argument's shape exchanged (the contents' digest covers the rest)
_SHAPE_DIMS = 4


@dataclass(frozen=True)
class VisionLanguageModel:
    """A multimodal model's parts: its inner model (the merge, the encoders) and its text model."""

    inner: nn.Module
    text: nn.Module


def vision_language_parts(hf_model: nn.Module, caller: str = "apply_upipe") -> VisionLanguageModel | None:
    """The parts of a vision-language model (None: not one; ValueError naming ``caller``: one UPipe cannot run
    exactly)."""
    inner = hf_model if _has_text_model(hf_model) else getattr(hf_model, "model", None)
    if not isinstance(inner, nn.Module) or not _has_text_model(inner):
        return None
    model_type = getattr(hf_model.config, "model_type", type(hf_model).__name__)
    name = type(hf_model).__name__
    if model_type in NON_CAUSAL_IMAGE_MASKS:
        raise ValueError(
            f"{caller}: {name} (model_type {model_type!r}) attends bidirectionally over image tokens (its mask "
            "lets an image's tokens see each other both ways) in a way UPipe does not run, so it would compute another "
            "model. Vision-language models with a causal mask, and Gemma 3's and Gemma 4's image overlays, run "
            "(docs/vlm.md)"
        )
    if not callable(getattr(inner, "get_image_features", None)) or not callable(getattr(hf_model, "lm_head", None)):
        raise ValueError(
            f"{caller}: {name} has a language_model but no get_image_features / lm_head: UPipe runs "
            "vision-language models laid out as transformers' ...ForConditionalGeneration (docs/vlm.md)"
        )
    return VisionLanguageModel(inner, inner.language_model)


def _has_text_model(module: Any) -> bool:
    return isinstance(getattr(module, "language_model", None), nn.Module) and not hasattr(module, "layers")


def check_vision_language(hf_model: nn.Module, ring: bool) -> None:
    if ring:
        raise ValueError(
            "apply_upipe: a vision-language model with ring_group: not supported yet (its merged sequence is cut "
            "into contiguous shards); run UPipe without a ring"
        )
    stack = getattr(hf_model, "_long_context_stack", None)
    if stack is not None and stack.tiled_loss:  # its forward would run under ours, given no labels: untiled
        raise ValueError(
            f"apply_upipe: {type(hf_model).__name__} already has the long-context stack's tiled loss: apply UPipe "
            "first, then apply_long_context_stack (prepare_model does), so the tiled loss takes this rank's shard "
            "of the whole sample's labels"
        )


def under_upipe(hf_model: nn.Module) -> bool:
    """Whether ``hf_model`` is a vision-language model patched by ``apply_upipe`` (``patch_vision_language``)."""
    return hasattr(hf_model, "_upipe_inner_forward")


def whole_sample_shift_labels(hf_model: nn.Module, labels: Tensor, attention_mask: Tensor | None) -> Tensor:
    """This rank's shard of the shifted labels of the whole sample's ``labels`` (padding, attention mask 0,
    ignored): what the patched forward's loss (and the long-context stack's tiled loss) takes over the group."""
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return shift_labels(labels)[:, _local_slice(labels.shape[1], hf_model._upipe_state)]


def check_shift_labels(hf_model: nn.Module, shifted: Tensor, call: dict[str, Any]) -> None:
    """``shift_labels`` given to a patched VLM must be this rank's shard of the whole sample's (``call``: the
    forward's arguments, the whole sample's ``input_ids`` or ``inputs_embeds``)."""
    tokens = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
    local = _local_slice(int(tokens.shape[1]), hf_model._upipe_state)
    if shifted.shape[-1] != local.stop - local.start:
        raise ValueError(
            f"{type(hf_model).__name__} under UPipe takes the whole sample's labels (it shifts and shards them), or "
            f"this rank's shard of the shifted labels ({local.stop - local.start} of the sample's "
            f"{tokens.shape[1]} tokens); got shift_labels of {shifted.shape[-1]}"
        )


def patch_vision_language(hf_model: nn.Module, parts: VisionLanguageModel, state: UPipeState) -> None:
    """Share the encoders out, shard the merged sequence before the text model, take the loss over the group."""
    for encoder in ENCODERS:
        function = getattr(type(parts.inner), encoder, None)  # the class's: a copy.deepcopy encodes with its own
        if callable(function):
            setattr(parts.inner, encoder, types.MethodType(_shared_encoder(function), parts.inner))
    rule = IMAGE_SPANS.get(getattr(hf_model.config, "model_type", None))
    if rule is not None:
        hook = _image_spans_hook(rule, rule.on(hf_model.config))
        parts.inner._upipe_spans_hook = parts.inner.register_forward_pre_hook(hook, with_kwargs=True)
    # before UPipe's own input check (registered earlier on the same module): it reads the shards
    parts.text._upipe_shard_hook = parts.text.register_forward_pre_hook(_shard_merged, with_kwargs=True, prepend=True)
    # a forward set on the instance before (TRL's fused LM head, ``add_fused_lm_head``) runs under ours
    hf_model._upipe_inner_forward = hf_model.__dict__.get("forward")
    hf_model.forward = types.MethodType(_forward, hf_model)


class ShareGather(torch.autograd.Function):
    """Every rank's rows of a [rows, ...] tensor, at their offsets of the whole [total, ...] one."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, start: int, total: int, group: dist.ProcessGroup | None) -> Tensor:
        ctx.start, ctx.rows, ctx.group = start, local.shape[0], group
        full = local.new_zeros(total, *local.shape[1:])
        full[start : start + local.shape[0]] = local
        dist.all_reduce(full, group=group)  # the other ranks' zeros add nothing: exact
        return full

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # each row's gradient comes from the rank holding its token
        return grad[ctx.start : ctx.start + ctx.rows], None, None, None


def image_share(count: int, rank: int, size: int) -> tuple[int, int]:
    """[first, end) of the images rank ``rank`` of ``size`` encodes: contiguous blocks, sizes differing by one."""
    return rank * count // size, (rank + 1) * count // size


def _shared_encoder(function: Any) -> Any:
    """The inner model's encoder (its class's ``function``), each rank encoding its share of the images and
    gathering the features."""
    signature = inspect.signature(function)

    def encode(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = _arguments(signature, (self, *args), kwargs)
        call.pop(next(iter(signature.parameters)))  # self
        pixel_name = list(signature.parameters)[1]
        state: UPipeState = self.language_model._upipe_state
        rows = _pixel_rows(call)
        _check_image_rows(type(self).__name__, call, pixel_name, rows)
        count = int(rows.shape[0]) if rows is not None else int(call[pixel_name].shape[0])
        rank = dist.get_rank(state.group)
        first, end = image_share(count, rank, state.group_size)
        empty = first == end
        encoded = range(first, end) if not empty else range(0, 1)  # an empty share runs the tower on image 0
        share, order = _share_sample_counts(_slice_images(call, pixel_name, rows, encoded), pixel_name, call, encoded)
        out = function(self, **share)
        encoded_features = list(out.pooler_output)
        features = [encoded_features[i] for i in order]  # in sample order, a stand-in dropped
        keep = 0 if empty else len(encoded)
        gathered = _gather_images(features, keep, first, count, state)
        # as the encoder returns them: a [images, tokens, hidden] tensor (Gemma 3) or one tensor per image
        out.pooler_output = torch.stack(gathered) if torch.is_tensor(out.pooler_output) else gathered
        if getattr(out, "deepstack_features", None) is not None:  # Qwen3-VL: per layer, per image
            out.deepstack_features = [
                _gather_images(list(layer), keep, first, count, state) for layer in out.deepstack_features
            ]
        for field in ("last_hidden_state", "hidden_states", "attentions"):
            if getattr(out, field, None) is not None:
                setattr(out, field, None)  # this rank's share only: not the whole sample's
        return out

    return encode


def _arguments(signature: inspect.Signature, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, the ``**kwargs`` flattened in."""
    bound = signature.bind(*args, **kwargs).arguments
    varkw = [p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
    extra = bound.pop(varkw[0], {}) if varkw else {}
    return {**bound, **extra}


def _pixel_rows(call: dict[str, Any]) -> Tensor | None:
    """Per image (video), its rows of the pixels: a grid's patches, a video's frames (None: one row an image)."""
    grid = next((call[k] for k in _GRIDS if call.get(k) is not None), None)
    return grid.prod(-1) if grid is not None else call.get(_FRAMES)


def _slice_images(call: dict[str, Any], pixel_name: str, rows: Tensor | None, images: range) -> dict[str, Any]:
    """The encoder's arguments for ``images`` only: pixel rows (``_pixel_rows`` per image, else one entry of
    dim 0 per image), the per-row arguments with them, and every per-image argument."""
    out = dict(call)
    first, end = images.start, images.stop
    if rows is not None:
        bounds = torch.cat([rows.new_zeros(1), rows.cumsum(0)]).tolist()
        first, end = bounds[first], bounds[end]
    for key in (pixel_name, *_PER_PIXEL_ROW):
        if call.get(key) is not None:
            out[key] = call[key][first:end]
    for key in _PER_IMAGE:
        if call.get(key) is not None:
            out[key] = call[key][images.start : images.stop]
    return out


def _check_image_rows(name: str, call: dict[str, Any], pixel_name: str, rows: Tensor | None) -> None:
    """With ``image_sizes``, the pixels must hold one entry per image (LLaVA-NeXT / OneVision: ``[images, tiles,
    C, H, W]``, as their processors give them), so that a share holds whole images, all their tiles."""
    sizes, pixels = call.get("image_sizes"), call.get(pixel_name)
    if rows is None and torch.is_tensor(sizes) and torch.is_tensor(pixels) and sizes.shape[0] != pixels.shape[0]:
        raise ValueError(
            f"{name} under UPipe: {pixel_name} of {pixels.shape[0]} rows for {sizes.shape[0]} image_sizes: the images "
            "are shared out over the sequence-parallel group whole, all tiles of an image on one rank, so pass the "
            f"pixels per image ([images, tiles, channels, height, width], as the processor gives them)"
        )


def _share_sample_counts(
    share: dict[str, Any], pixel_name: str, call: dict[str, Any], images: range
) -> tuple[dict[str, Any], list[int]]:
    """The share's encoder arguments with per-sample image counts (``_SAMPLE_IMAGES``) of its own, and the order
    of its features by image.  The model tiles an image only where its sample has one image
    (``get_image_features``: ``n == 1`` per sample), so the share's counts must give each of its images its flag:
    its tiled images first (a count of 1 each), then its untiled ones as one sample (a count >= 2).  A lone
    untiled image (one of a multi-image sample, the rest on other ranks) gets a stand-in copy of itself: no count
    says "untiled" of one image; the copy's features are dropped (its tower gradients zeros)."""
    if call.get(_SAMPLE_IMAGES) is None:
        return share, list(range(len(images)))
    counts = torch.as_tensor(call[_SAMPLE_IMAGES])
    tiled = [int(n) == 1 for n in counts.tolist() for _ in range(int(n))][images.start : images.stop]
    order = sorted(range(len(tiled)), key=lambda i: not tiled[i])  # stable: tiled images first
    untiled = len(tiled) - sum(tiled)
    index = torch.tensor(order + order[-1:] * (untiled == 1))
    out = dict(share)
    out[pixel_name], out["image_sizes"] = share[pixel_name][index], share["image_sizes"][index]
    out[_SAMPLE_IMAGES] = counts.new_tensor([1] * sum(tiled) + [max(untiled, 2)] * (untiled > 0))
    return out, [order.index(i) for i in range(len(order))]


def _gather_images(encoded: list[Tensor], keep: int, first: int, count: int, state: UPipeState) -> tuple[Tensor, ...]:
    """Every image's [tokens, hidden] features from each rank's share: this rank's first ``keep`` encoded
    images (images ``first``...; an empty share keeps none of its stand-in but stays in the graph, so the
    tower's backward runs with zeros), one all-reduce of the row counts, one ``ShareGather`` of the rows."""
    local = torch.cat(encoded)
    rows = torch.zeros(count, dtype=torch.long, device=local.device)
    rows[first : first + keep] = torch.tensor([f.shape[0] for f in encoded[:keep]], dtype=torch.long)
    dist.all_reduce(rows, group=state.group)
    sizes = rows.tolist()
    start = sum(sizes[:first])
    full = ShareGather.apply(local[: sum(sizes[first : first + keep])], start, sum(sizes), state.group)
    return torch.split(full, sizes)


def _image_spans_hook(rule: ImageSpanRule, on: bool) -> Any:
    """The inner model's forward pre-hook of an ``IMAGE_SPANS`` model: the whole sample's image spans from its
    ``rule.marks`` argument by the model module's ``rule.block_ids`` function, to the text model as
    ``SPANS_KWARG`` (none without marks or with the overlay off, ``on``: the model's mask is then causal), the
    2-D mask beside them (``_PADDING_KWARG``)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        call = _as_kwargs(type(module).forward, (module, *args), kwargs)
        call.pop("self")
        marked = call.get(rule.marks) if on else None
        block_ids = getattr(sys.modules[type(module).__module__], rule.block_ids)
        ids = None if marked is None else block_ids(marked, device=marked.device)
        call[SPANS_KWARG] = None if ids is None else BidirectionalSpans.of_block_ids(ids, rule.sliding_only)
        call[_PADDING_KWARG] = call.get("attention_mask")
        return (), call

    return hook


def _local_slice(seq: int, state: UPipeState) -> slice:
    """This rank's contiguous shard of a ``seq``-token sequence (ValueError, on every rank alike, when the
    whole sample's length is no multiple of the group size)."""
    if seq % state.group_size:
        raise ValueError(
            f"a vision-language sample of {seq} tokens (after the model's merge) is no multiple of the "
            f"sequence-parallel size {state.group_size}: pad input_ids, labels (-100) and attention_mask (0) at the "
            "end to a multiple of it (every rank passes the whole sample)"
        )
    local = seq // state.group_size
    rank = dist.get_rank(state.group)
    return slice(rank * local, (rank + 1) * local)


def _shard_merged(text: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of the text model: the merged whole-sample inputs cut to this rank's shard."""
    call = _as_kwargs(text.forward, args, kwargs)
    state: UPipeState = text._upipe_state
    tokens = call.get("inputs_embeds")
    tokens = call.get("input_ids") if tokens is None else tokens
    batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
    local = _local_slice(seq, state)
    positions = call.get("position_ids")
    # the text positions of the whole sample, as the unsharded text model makes them where none are passed
    text_positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
    if positions is None:
        positions = text_positions
    elif positions.dim() == 3 and positions.shape[0] == 3:  # mrope: transformers' [4, B, S], text positions first
        positions = torch.cat([text_positions.unsqueeze(0).to(positions.dtype), positions])
    call["position_ids"] = positions[..., local]
    padding, masks = call.pop(_PADDING_KWARG, None), call.get("attention_mask")
    if isinstance(masks, dict) and all(m is None for m in masks.values()):  # an IMAGE_SPANS model's per-layer masks
        call["attention_mask"] = padding
    for key in ("inputs_embeds", "input_ids", "attention_mask", "per_layer_inputs"):  # Gemma 4's [B, S, layers, D]
        if torch.is_tensor(call.get(key)):
            call[key] = call[key][:, local]
    for key in ("inputs_embeds", "per_layer_inputs"):
        if torch.is_tensor(call.get(key)):
            # a copy of the shard: a view would keep the whole sample's merged [B, S, hidden] embeddings alive
            # through the backward (as the first layer's saved input); the copy lets them go when the forward returns
            call[key] = call[key].clone()
    visual = call.get("visual_pos_masks")
    if visual is not None:  # Qwen3-VL's deepstack: the rows of this shard's visual tokens
        mine = torch.zeros_like(visual)
        mine[:, local] = True
        rows = mine[visual]
        call["deepstack_visual_embeds"] = [embeds[rows] for embeds in call["deepstack_visual_embeds"]]
        call["visual_pos_masks"] = visual[:, local]
    return (), call


def _digest(t: Tensor) -> Tensor:
    """A 0-d int64 digest of ``t``'s contents, exact and independent of its layout: the bits of each element
    (floats viewed as integers of their width) summed per row of the last dim (integers: per element), each row
    weighted by its index, so that a reordering changes it.  One pass over ``t``."""
    bits = t.detach().contiguous()
    if bits.dtype == torch.bool:
        bits = bits.to(torch.uint8)
    elif bits.is_floating_point():
        bits = bits.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[bits.element_size()])
    if bits.numel() == 0:
        return torch.zeros((), dtype=torch.long, device=t.device)
    rows = bits.reshape(-1)
    if t.is_floating_point() and t.dim() > 0:  # large (pixels, embeddings): no int64 copy of every element
        rows = bits.reshape(-1, bits.shape[-1]).sum(-1, dtype=torch.long)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.long, device=t.device)
    return (rows.long() * weights).sum()  # int64 wraps around: the same on every rank


def check_same_sample(name: str, call: dict[str, Any], state: UPipeState) -> None:
    """Raise the same ValueError on every rank of the group unless every rank passes the same sample (shape and
    digest of each of ``SAMPLE_ARGUMENTS``): ranks given different samples (a loader that shards by rank) would
    wait in the tower's collectives, sized by their own image counts, forever.  One all_gather of
    ``len(SAMPLE_ARGUMENTS) * (_SHAPE_DIMS + 2)`` int64 per forward, before any collective whose shape depends on
    the sample, and one host read of it."""
    if state.group_size == 1:
        return
    shards = _SHARDS if torch.is_tensor(call.get("shift_labels")) else ()
    tokens = call.get("input_ids") if torch.is_tensor(call.get("input_ids")) else call.get("inputs_embeds")
    device = tokens.device if torch.is_tensor(tokens) else torch.device("cpu")
    shapes: list[int] = []
    digests = []
    for key in SAMPLE_ARGUMENTS:
        t = call.get(key)
        present = torch.is_tensor(t)
        dims = list(t.shape[:_SHAPE_DIMS]) if present else []
        shapes += [t.dim() if present else -1, *dims, *[-1] * (_SHAPE_DIMS - len(dims))]
        whole = present and key not in shards
        digests.append(_digest(t).to(device) if whole else torch.zeros((), dtype=torch.long, device=device))
    mine = torch.cat([torch.tensor(shapes, dtype=torch.long, device=device), torch.stack(digests)])
    rows = [row.tolist() for row in gather_over_sequence_group(mine, state)]
    per_rank = []
    width, count = _SHAPE_DIMS + 1, len(SAMPLE_ARGUMENTS)
    for row in rows:
        record: dict[str, Any] = {}
        for i, key in enumerate(SAMPLE_ARGUMENTS):
            ndim, *dims = row[i * width : (i + 1) * width]
            record[f"{key} shape"] = None if ndim < 0 else tuple(dims[: min(ndim, _SHAPE_DIMS)])
            record[f"{key} contents"] = row[count * width + i]
        per_rank.append(record)
    differ = mismatched_settings(per_rank)
    if not differ:
        return
    first = next(r for r, record in enumerate(per_rank) if record != per_rank[0])
    shown = []
    for key, values in differ.items():
        if key.endswith(" shape"):
            shown.append(f"{key} per rank {['absent' if v is None else v for v in values]}")
        elif f"{key.removesuffix(' contents')} shape" not in differ:
            shown.append(f"{key} differ on ranks {[r for r, v in enumerate(values) if v != values[0]]}")
    raise ValueError(
        f"{name} under UPipe: rank {first}'s sample differs from rank 0's (ranks of the sequence-parallel group): "
        f"{'; '.join(shown)}. Every rank of the sequence-parallel group must pass the whole sample, the same "
        "input_ids, images and labels (a loader that shards by rank gives each rank another one; the Trainer / TRL "
        "routes exchange the whole sample: docs/vlm.md)"
    )


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The causal LM's forward on the whole sample: logits of this rank's shard; the loss over the group of the
    whole sample's ``labels``, or, given this rank's shard of the shifted labels (``shift_labels``, as a
    sequence-parallel loader gives them: ``hf_patches.data.vision_language_micro_batch``), what the model (or
    the forward set on the instance before, TRL's fused LM head) computes from them: the shard's own loss."""
    call = _arguments(inspect.signature(type(self).forward), (self, *args), kwargs)
    call.pop("self")
    inner = self.__dict__.get("_upipe_inner_forward")
    forward = inner if inner is not None else types.MethodType(type(self).forward, self)
    state: UPipeState = self._upipe_state
    check_same_sample(type(self).__name__, call, state)  # before the tower's collectives, sized by the images
    audio = [key for key in AUDIO_INPUTS if call.get(key) is not None]
    if audio:
        raise ValueError(
            f"{type(self).__name__} under UPipe: audio inputs ({', '.join(audio)}) are not supported (the audio tower "
            "is not shared out over the sequence-parallel group); pass images and videos only"
        )
    shifted = call.get("shift_labels")
    if shifted is not None:
        check_shift_labels(self, shifted, call)
        return forward(**call)
    labels = call.pop("labels", None)
    if labels is not None and call.get("fused_lm_head"):
        raise ValueError(
            f"{type(self).__name__} under UPipe with fused_lm_head=True scores this rank's shard: pass its "
            "shift_labels (hf_patches.data.vision_language_micro_batch), not the whole sample's labels"
        )
    out = forward(**call)
    if labels is not None:
        shifted = whole_sample_shift_labels(self, labels, call.get("attention_mask"))
        out.loss = sequence_parallel_loss(out.logits, shifted, state.group)
    return out
