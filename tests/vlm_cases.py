"""Rank-side bodies of tests/test_vlm.py: tiny vision-language models (Qwen2.5-VL, Qwen3-VL, LLaVA, Mistral 3, Gemma 3,
Gemma 4)
patched by ``apply_upipe`` against the same model unpatched in one process, float64: logits, loss and every gradient
(the vision tower's and projector's included), with images across the shard boundaries and shares of images
that are uneven or empty.  One spawn of 4 ranks runs C = 4 and C = 2 (two pairs)."""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist

import hf_patches
from ds_upipe.tools.parity import GRADIENT_FLOOR, compare, float64_internals, relative_error
from hf_patches.vlm import whole_sample_shift_labels

IMAGE, VIDEO, VISION_START = 120, 121, 122
TEXT = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def build_qwen2_5_vl(seed: int = 0) -> torch.nn.Module:
    """Qwen2.5-VL: a 2-block vision tower (window and full attention), patch 2, spatial merge 2 (4 patches a
    token), 3-D mrope (sections 2, 1, 1 of head_dim 8)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0}
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        out_hidden_size=64,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=2,
        window_size=8,
        fullatt_block_indexes=[1],
    )
    config = Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_parameters": rope},
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).double()


#: the tiny vision tower of Qwen3-VL and Qwen3.5 (the same tower; Qwen3-VL adds deepstack indexes)
QWEN3_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=4,
    patch_size=2,
    temporal_patch_size=1,
    spatial_merge_size=2,
    out_hidden_size=64,
    num_position_embeddings=16,
)


def build_qwen3_vl(seed: int = 0) -> torch.nn.Module:
    """Qwen3-VL: as Qwen2.5-VL's, with interleaved mrope and deepstack features of both vision blocks added to
    the first two decoder layers' visual tokens."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0, "mrope_interleaved": True}
    vision = {**QWEN3_VISION, "deepstack_visual_indexes": [0, 1]}
    config = Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 8, "rope_parameters": rope},
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).double()


def build_qwen3_5_vl(seed: int = 0, moe: bool = False) -> torch.nn.Module:
    """Qwen3.5 (``moe``: Qwen3.5-MoE): Qwen3-VL's tower without deepstack, a hybrid text model (a gated delta net
    layer, then a softmax attention layer: H_v = 8, H_k = 4), interleaved mrope on half of head_dim 16 (4
    frequencies: T, H, W, T), weights moved off their init values (norms of ones, dt_bias ones)."""
    import transformers

    rope = {
        "rope_type": "default",
        "mrope_section": [2, 1, 1],
        "rope_theta": 10000.0,
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    }
    text = {
        **TEXT,
        "head_dim": 16,
        "rope_parameters": rope,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "use_cache": False,
    }
    if moe:  # transformers' grouped_mm experts take no float64: its per-expert loop
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    extra = {"experts_implementation": "eager"} if moe else {}
    vision = dict(QWEN3_VISION)
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(
        text_config=text,
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        **extra,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).double()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("dt_bias", "A_log", "norm.weight")):
                p.add_(0.3 * torch.randn_like(p))
    return model


def build_llava(seed: int = 0) -> torch.nn.Module:
    """LLaVA: a 2-layer CLIP tower on 8x8 images, patch 2 (16 tokens an image, the CLS token dropped)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    vision = dict(
        model_type="clip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=8,
        patch_size=2,
    )
    config = LlavaConfig(
        text_config={"model_type": "llama", **TEXT},
        vision_config=vision,
        image_token_id=IMAGE,
        vision_feature_layer=-1,
        image_seq_length=16,
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config).double()


def build_mistral3(seed: int = 0) -> torch.nn.Module:
    """Mistral 3: a 2-layer Pixtral tower (images of their own sizes, padded in one tensor), patch 2, its patch
    merger (spatial merge 2: 4 patches a token)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    vision = dict(
        model_type="pixtral",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=2,
        head_dim=8,
    )
    config = Mistral3Config(
        text_config={"model_type": "mistral", **TEXT, "head_dim": 8, "sliding_window": None},
        vision_config=vision,
        image_token_index=IMAGE,
        spatial_merge_size=2,
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(config).double()


def build_llava_onevision(seed: int = 0) -> torch.nn.Module:
    """LLaVA-OneVision: a 2-layer SigLIP tower on 4x4 tiles, patch 2 (4 tokens a tile); anyres tiling over the
    pinpoints 4x4, 4x8, 8x4, 8x8 (an 8x8 image: a base tile and 4 others, 24 tokens with its image_newlines; a 4x8
    one: 3 tiles, 14 tokens; an image of a multi-image sample: 1 tile, 5 tokens); a video frame pooled to 1 token."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration

    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=4,
        patch_size=2,
        vision_use_head=False,
    )
    config = LlavaOnevisionConfig(
        text_config={"model_type": "qwen2", **TEXT},
        vision_config=vision,
        image_token_index=IMAGE,
        video_token_index=VIDEO,
        vision_feature_layer=-1,
        image_grid_pinpoints=[[4, 4], [4, 8], [8, 4], [8, 8]],
    )
    torch.manual_seed(seed)
    return LlavaOnevisionForConditionalGeneration(config).double()


def build_gemma3(seed: int = 0) -> torch.nn.Module:
    """Gemma 3: a 1-layer SigLIP tower on 8x8 images, patch 2, pooled to 16 tokens an image; a sliding layer of
    window 4 (shorter than an image) on either side of a full one, all with the image overlay of ``token_type_ids``
    (the first two's overlays reach the text tokens' logits, the loss and the gradients)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    layers = ["sliding_attention", "full_attention", "sliding_attention"]
    text = {**TEXT, "head_dim": 8, "sliding_window": 4, "num_hidden_layers": 3, "layer_types": layers}
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=8, patch_size=2
    )
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16, image_token_id=IMAGE)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config).double()


def build_gemma4(seed: int = 0, overlay: bool = True) -> torch.nn.Module:
    """Gemma 4: a 1-layer tower on images (frames) of 8x8 patches, pooled 2x2 to 16 tokens (its pooler's one-hot
    weights kept float64: ``float64_internals(integers=True)``); text layers sliding
    (window 4, shorter than an image) / full, twice, the last two KV-shared (they reuse layers 0 and 1's keys and
    values), per-layer inputs, the overlay of ``mm_token_type_ids`` on the sliding layers only
    (``use_bidirectional_attention="vision"``; ``overlay=False``: None, the smaller checkpoints' causal mask); no
    audio tower."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {
        **TEXT,
        "head_dim": 8,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 4,
        "global_head_dim": 16,
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 101,
        "hidden_size_per_layer_input": 8,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": "vision" if overlay else None,
    }
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        patch_size=2,
        pooling_kernel_size=2,
        position_embedding_size=16,
    )
    tokens = dict(boi_token_id=123, eoi_token_id=124, boa_token_id=125, eoa_token_index=126, audio_token_id=127)
    config = Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, image_token_id=IMAGE, video_token_id=VIDEO, **tokens
    )
    torch.manual_seed(seed)
    return Gemma4ForConditionalGeneration(config).double()


def _tokens(batch: int, seq: int, images: list[tuple[int, int, int]], seed: int) -> dict[str, torch.Tensor]:
    """input_ids with image placeholders (row, first token, token count), labels ignoring them."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (batch, seq), generator=gen)
    for row, start, count in images:
        ids[row, start : start + count] = IMAGE
    labels = ids.masked_fill(ids == IMAGE, -100)
    return {"input_ids": ids, "labels": labels}


def qwen_sample(seed: int) -> dict[str, torch.Tensor]:
    """Two rows of 24 tokens, three images (4, 8 and 4 tokens; grids 4x4, 4x8, 4x4 patches): the second
    crosses the C = 2 boundary (12) and the C = 4 one (12), the first the C = 4 one (6)."""
    grids = torch.tensor([[1, 4, 4], [1, 4, 8], [1, 4, 4]])
    sample = _tokens(2, 24, [(0, 4, 4), (0, 9, 8), (1, 16, 4)], seed)
    sample["mm_token_type_ids"] = (sample["input_ids"] == IMAGE).long()
    gen = torch.Generator().manual_seed(seed + 1)
    sample["pixel_values"] = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 2, generator=gen, dtype=torch.float64)
    sample["image_grid_thw"] = grids
    return sample


def qwen_video_sample(seed: int) -> dict[str, torch.Tensor]:
    """``qwen_sample`` with a video of 2 frames (8 tokens) in row 1, across the C = 4 boundary 6 (Qwen2.5-VL:
    one placeholder run per video)."""
    sample = qwen_sample(seed)
    sample["input_ids"][1, 3:11] = VIDEO
    sample["labels"][1, 3:11] = -100
    sample["mm_token_type_ids"][1, 3:11] = 2
    sample["video_grid_thw"] = torch.tensor([[2, 4, 4]])
    gen = torch.Generator().manual_seed(seed + 2)
    sample["pixel_values_videos"] = torch.randn(32, 3 * 2 * 2, generator=gen, dtype=torch.float64)
    return sample


def qwen3_5_sample(seed: int) -> dict[str, torch.Tensor]:
    """``qwen_sample`` with a video of 2 frames (4 tokens each) in row 1, as Qwen3.5's processor lays a video out:
    one placeholder run per frame, a timestamp token between them (frame 1 crosses the C = 4 boundary 6, frame 2
    ends at the C = 2 and C = 4 boundary 12)."""
    sample = qwen_sample(seed)
    for frame in (slice(3, 7), slice(8, 12)):
        sample["input_ids"][1, frame] = VIDEO
        sample["labels"][1, frame] = -100
        sample["mm_token_type_ids"][1, frame] = 2
    sample["video_grid_thw"] = torch.tensor([[2, 4, 4]])
    gen = torch.Generator().manual_seed(seed + 2)
    sample["pixel_values_videos"] = torch.randn(32, 3 * 2 * 2, generator=gen, dtype=torch.float64)
    return sample


def llava_sample(seed: int) -> dict[str, torch.Tensor]:
    """One row of 48 tokens, two images of 16 tokens: the second crosses the C = 2 boundary (24), both cross
    a C = 4 one (12, 24)."""
    sample = _tokens(1, 48, [(0, 2, 16), (0, 20, 16)], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sample["pixel_values"] = torch.randn(2, 3, 8, 8, generator=gen, dtype=torch.float64)
    return sample


def mistral3_sample(seed: int) -> dict[str, torch.Tensor]:
    """One row of 24 tokens, an 8x8 image (4 tokens, across the C = 4 boundary 6) and an 8x16 one (8 tokens,
    across the C = 2 boundary 12), padded into one [2, 3, 8, 16] tensor with their ``image_sizes``."""
    sample = _tokens(1, 24, [(0, 3, 4), (0, 9, 8)], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pixels = torch.randn(2, 3, 8, 16, generator=gen, dtype=torch.float64)
    pixels[0, :, :, 8:] = 0
    sample.update(pixel_values=pixels, image_sizes=torch.tensor([[8, 8], [8, 16]]))
    return sample


def llava_onevision_sample(seed: int) -> dict[str, torch.Tensor]:
    """Three rows of 32 tokens as LLaVA-OneVision's processor lays them out (``batch_num_images`` [3, 1, 1]): row 0
    three images of one tile each (5 tokens: [5, 10) across the C = 4 boundary 8, [13, 18) across 16, [18, 23)) and
    a video of 2 frames (3 tokens, [23, 26) across 24); row 1 an 8x8 image (5 tiles, 24 tokens, [4, 28) across 8,
    16 and 24); row 2 a 4x8 one (3 tiles, 14 tokens, [12, 26) across 16 and 24).  The pixels per image, padded to
    5 tiles: ``[5, 5, 3, 4, 4]`` with ``image_sizes``.  Shares: C = 4 one untiled image alone on each of ranks 0-2
    (a stand-in copy each), C = 2 rank 1 an untiled image beside the two tiled ones."""
    sample = _tokens(3, 32, [(0, 5, 5), (0, 13, 10), (1, 4, 24), (2, 12, 14)], seed)
    sample["input_ids"][0, 23:26] = VIDEO
    sample["labels"][0, 23:26] = -100
    gen = torch.Generator().manual_seed(seed + 1)
    tiles = (1, 1, 1, 5, 3)
    pixels = torch.randn(5, 5, 3, 4, 4, generator=gen, dtype=torch.float64)
    for image, count in enumerate(tiles):
        pixels[image, count:] = 0
    sample.update(
        pixel_values=pixels,
        image_sizes=torch.tensor([[4, 4], [8, 4], [4, 8], [8, 8], [4, 8]]),
        batch_num_images=torch.tensor([3, 1, 1]),
        pixel_values_videos=torch.randn(1, 2, 3, 4, 4, generator=gen, dtype=torch.float64),
    )
    return sample


def llava_onevision_tiled_sample(seed: int) -> dict[str, torch.Tensor]:
    """One row of 64 tokens, no ``batch_num_images`` (the model then tiles every image): a 4x8 image (3 tiles, 14
    tokens, [4, 18) across the C = 4 boundary 16), an 8x4 one (3 tiles, 16 tokens, [24, 40) across 32) and an 8x8
    one (5 tiles, 24 tokens, [40, 64) across 48); 3 images over 4 ranks: one share empty."""
    sample = _tokens(1, 64, [(0, 4, 14), (0, 24, 40)], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pixels = torch.randn(3, 5, 3, 4, 4, generator=gen, dtype=torch.float64)
    pixels[:2, 3:] = 0
    sample.update(pixel_values=pixels, image_sizes=torch.tensor([[4, 8], [8, 4], [8, 8]]))
    return sample


def gemma3_sample(seed: int) -> dict[str, torch.Tensor]:
    """Two rows of 48 tokens, four images of 16 tokens: row 0 two images a text token apart, [2, 18) and [19, 35)
    (across the C = 4 boundary 12 and the C = 2 one 24); row 1 two images back to back, [5, 21) and [21, 37),
    which transformers' ``token_type_ids`` overlay makes one span (across 12, 24 and 36), then 4 tokens of right
    padding (``attention_mask`` 0: the 2-D mask reaches UPipe's input check beside the model's per-layer masks)."""
    sample = _tokens(2, 48, [(0, 2, 16), (0, 19, 16), (1, 5, 32)], seed)
    sample["token_type_ids"] = (sample["input_ids"] == IMAGE).long()
    sample["attention_mask"] = torch.ones_like(sample["input_ids"])
    sample["attention_mask"][1, 44:] = 0
    sample["input_ids"][1, 44:] = TEXT["pad_token_id"]
    sample["labels"][1, 44:] = -100
    gen = torch.Generator().manual_seed(seed + 1)
    sample["pixel_values"] = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64)
    return sample


def _patch_positions(width: int, height: int) -> torch.Tensor:
    """Gemma 4's (x, y) of each patch of a ``width`` x ``height`` image, row by row: ``[patches, 2]``."""
    return torch.stack(torch.meshgrid(torch.arange(width), torch.arange(height), indexing="xy"), -1).reshape(-1, 2)


def gemma4_sample(seed: int) -> dict[str, torch.Tensor]:
    """``gemma3_sample``'s rows: row 0 two images of 16 tokens a text token apart, [2, 18) and [19, 35) (across the
    C = 4 boundary 12 and the C = 2 one 24); row 1 a video of two 16-token frames back to back, [5, 37) (one span,
    across 12, 24 and 36; ``num_frames_per_video``), then 4 tokens of right padding.  Pixels as Gemma 4's processor
    gives them: ``[images (frames), 64 patches, 2 * 2 * 3]`` with each patch's (x, y) position (8 x 8 and 16 x 4
    patches: each image's and frame's own positions)."""
    sample = _tokens(2, 48, [(0, 2, 16), (0, 19, 16), (1, 5, 32)], seed)
    sample["input_ids"][1, 5:37] = VIDEO
    sample["mm_token_type_ids"] = (sample["input_ids"] == IMAGE).long() + 2 * (sample["input_ids"] == VIDEO).long()
    sample["labels"] = sample["labels"].masked_fill(sample["mm_token_type_ids"] > 0, -100)
    sample["attention_mask"] = torch.ones_like(sample["input_ids"])
    sample["attention_mask"][1, 44:] = 0
    sample["input_ids"][1, 44:] = TEXT["pad_token_id"]
    sample["labels"][1, 44:] = -100
    gen = torch.Generator().manual_seed(seed + 1)
    square, wide = _patch_positions(8, 8), _patch_positions(16, 4)
    sample["pixel_values"] = torch.rand(2, 64, 12, generator=gen, dtype=torch.float64)
    sample["image_position_ids"] = torch.stack([square, wide])
    sample["pixel_values_videos"] = torch.rand(2, 64, 12, generator=gen, dtype=torch.float64)
    sample["video_position_ids"] = torch.stack([wide, square])
    sample["num_frames_per_video"] = torch.tensor([2])
    return sample


MODELS = {
    "qwen2_5_vl": (build_qwen2_5_vl, qwen_video_sample),
    "qwen3_vl": (build_qwen3_vl, qwen_sample),
    "llava": (build_llava, llava_sample),
    "mistral3": (build_mistral3, mistral3_sample),
    "llava_onevision": (build_llava_onevision, llava_onevision_sample),
    "qwen3_5": (build_qwen3_5_vl, qwen3_5_sample),
    "qwen3_5_moe": (functools.partial(build_qwen3_5_vl, moe=True), qwen3_5_sample),
    "gemma3": (build_gemma3, gemma3_sample),
    "gemma4": (build_gemma4, gemma4_sample),
}
#: the Qwen models of MODELS also run packed (``packed_case``), they and Gemma 3 with gradient checkpointing (C = 2)
PACKED = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
CHECKPOINTED = ("qwen2_5_vl", "qwen3_5", "gemma3")
#: models run at C = 4 only: Gemma 4 with its overlay off (its mask causal although ``mm_token_type_ids`` are given),
#: LLaVA-OneVision without ``batch_num_images`` (every image tiled)
VARIANTS = {
    "gemma4 causal": (functools.partial(build_gemma4, overlay=False), gemma4_sample),
    "llava_onevision all tiled": (build_llava_onevision, llava_onevision_tiled_sample),
}
#: models run with ``float64_internals(integers=True)`` (Gemma 4's pooler: one-hot ``.float()`` weights)
FLOAT64_INTEGERS = ("gemma4", "gemma4 causal")


#: the models run with the long-context stack (C = 2)
STACKED = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
#: the long-context stack's keys of a ds_config's "upipe" block (tiles of 5 and 7 tokens: several per shard of
#: 2 rows x 12 positions)
STACK = {"tiled_loss": {"tile_tokens": 5}, "tiled_norm": {"tile_tokens": 5}, "tiled_mlp": {"tile_tokens": 7}}


def parity_case(
    name: str,
    group: dist.ProcessGroup,
    seed: int = 0,
    checkpointing: bool = False,
    stack: bool = False,
    **settings: Any,
) -> dict[str, float]:
    """The patched VLM given the whole sample on every rank == the unpatched VLM (float64).  The patched
    loss's gradients are for a group that averages them (``sequence_parallel_loss``'s "mean"): the sum over
    the group divided by its size is compared.  ``settings``: ``apply_upipe``'s.  ``stack``: prepared as the
    engine route prepares it from a ds_config with the long-context stack's keys (``STACK``: UPipe, then the
    tiled norms, MLPs and loss of the text model); no logits, so loss and gradients are compared, and the loss
    of this rank's shard of the shifted labels (a loader's ``shift_labels``) is the same."""
    build, make = MODELS[name] if name in MODELS else VARIANTS[name]
    model = build(seed)
    if checkpointing:  # transformers' gradient checkpointing of the text layers and the vision blocks
        model.gradient_checkpointing_enable()
        model.train()
    ref_model = copy.deepcopy(model)
    sample = make(seed)
    ref_model.zero_grad(set_to_none=True)
    ref = ref_model(**sample)
    ref.loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters() if p.grad is not None}

    if stack:
        _prepare_with_stack(model, group)
    else:
        hf_patches.apply_upipe(model, group, **settings)
    out = model(**sample)
    out.loss.backward()
    size = dist.get_world_size(group)
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=group)
            grads[n] = g / size
    if stack:  # no logits to compare
        errors = compare((ref.logits, ref.loss.detach(), ref_grads), (ref.logits, out.loss.detach(), grads), 10**6)
        errors.pop("logits")
        errors.update(_stack_checks(model, sample, out, ref.logits.detach()))
    else:
        logits = hf_patches.gather_sequence(out.logits.detach(), group)
        # the real tokens' logits: a right-padded position's are unspecified under UPipe (docs/vlm.md)
        real = sample.get("attention_mask", torch.ones_like(sample["input_ids"])).bool()
        errors = compare(
            (ref.logits.detach()[real], ref.loss.detach(), ref_grads), (logits[real], out.loss.detach(), grads), 10**6
        )
    tower = [n for n in ref_grads if _is_tower(n)]
    errors["tower_grads_present"] = float(not tower or any(n not in grads for n in tower))
    errors["tower_attention"] = float(model.config.vision_config._attn_implementation != "sdpa")
    return errors


def _is_tower(name: str) -> bool:
    """Whether the parameter ``name`` is the vision tower's or the projector's."""
    return "visual" in name or "vision_tower" in name or "projector" in name


def _prepare_with_stack(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """What ``ds_upipe.initialize`` does to the model with ``STACK`` in its ds_config (the loss over ``group``)."""
    from ds_upipe.integration.hf_integration import upipe_settings
    from ds_upipe.integration.sp_setup import prepare_for_run

    settings = upipe_settings(
        {"upipe": {"enabled": True, **STACK}, "zero_optimization": {"stage": 1}}, dist.get_world_size(group)
    )
    prepare_for_run(
        model, settings, sequence_group=group, head_chunk_size=None, forward_loss="sequence_parallel", loss_group=group
    )


def _stack_checks(
    model: torch.nn.Module, sample: dict[str, torch.Tensor], out: Any, ref_logits: torch.Tensor
) -> dict[str, float]:
    """The stack's text modules only (2 layers' norms and MLPs, the final norm, the forward; no vision module's
    forward replaced), no logits; from this rank's shard of the shifted labels (a loader's ``shift_labels``) the
    same loss (``forward_loss`` "sequence_parallel", the engine's) and, with "local" (the Trainer route's), the
    shard's own mean token loss of the unpatched model's logits; ranks given different labels refused by the
    same-sample check, as the patched forward refuses them."""
    stack = hf_patches.long_context_stack(model)
    tower = model.model.visual if hasattr(model.model, "visual") else model.model.vision_tower
    local = whole_sample_shift_labels(model, sample["labels"], sample.get("attention_mask"))
    n = local.shape[1]
    first = dist.get_rank(model._upipe_state.group) * n
    shard = ref_logits[:, first : first + n]
    own = torch.nn.functional.cross_entropy(shard.reshape(-1, shard.shape[-1]), local.reshape(-1), ignore_index=-100)
    without_labels = {k: v for k, v in sample.items() if k != "labels"}
    with torch.no_grad():
        group_loss = model(**without_labels, shift_labels=local).loss
        stack.forward_loss = "local"
        shard_loss = model(**without_labels, shift_labels=local).loss
        stack.forward_loss = "sequence_parallel"
    other = {**sample, "labels": sample["labels"].roll(dist.get_rank(), dims=1)}  # rank 0's differs from rank 1's
    try:
        model(**other)
        refused = "no error"
    except ValueError as err:
        refused = str(err)
    return {
        "same_sample_checked": float("sample differs from rank 0's" not in refused),
        "stack_patched": float(len(stack.patched) != 2 * 3 + 2 or "forward" not in stack.patched),
        "tower_untouched": float(any("forward" in vars(m) for m in tower.modules())),
        "logits_none": float(out.logits is not None),
        "shift_labels_loss": relative_error(group_loss, out.loss.detach()),
        "shift_labels_local_loss": relative_error(shard_loss, own),
    }


def packed_case(name: str, group: dist.ProcessGroup, seed: int = 0) -> dict[str, float]:
    """The two rows of the model's Qwen sample packed into one row of 48 tokens, with the positions transformers
    takes for packed rows ([4, B, S]: the text positions restarting at the second sample, then each sample's mrope
    positions from the model's own ``get_rope_index``) == each sample run alone by the unpatched model.  A video
    of the sample (row 1) goes with the second sample."""
    build, make = MODELS[name]
    model = build(seed)
    ref_model = copy.deepcopy(model)
    rows = make(seed)
    grids = rows["image_grid_thw"]
    patches = grids.prod(-1).tolist()
    docs = []
    for row, images in ((0, slice(0, 2)), (1, slice(2, 3))):
        first = sum(patches[: images.start])
        doc = {k: rows[k][row : row + 1] for k in ("input_ids", "labels", "mm_token_type_ids")}
        doc["image_grid_thw"] = grids[images]
        doc["pixel_values"] = rows["pixel_values"][first : first + sum(patches[images])]
        docs.append(doc)
    videos = {k: rows[k] for k in ("video_grid_thw", "pixel_values_videos") if k in rows}
    docs[1].update(videos)
    ref_model.zero_grad(set_to_none=True)
    outs = [ref_model(**doc) for doc in docs]
    counts = [int((hf_patches.shift_labels(doc["labels"]) != -100).sum()) for doc in docs]
    ref_loss = sum(out.loss * n for out, n in zip(outs, counts)) / sum(counts)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters() if p.grad is not None}
    ref_logits = torch.cat([out.logits.detach() for out in outs], dim=1)

    positions = []
    for doc in docs:
        mrope, _ = ref_model.model.get_rope_index(
            doc["input_ids"],
            doc["mm_token_type_ids"],
            image_grid_thw=doc["image_grid_thw"],
            video_grid_thw=doc.get("video_grid_thw"),
        )
        text = torch.arange(doc["input_ids"].shape[1]).view(1, 1, -1)
        positions.append(torch.cat([text, mrope]))
    packed = {k: torch.cat([doc[k] for doc in docs], dim=1) for k in ("input_ids", "labels", "mm_token_type_ids")}
    packed["labels"][0, docs[0]["input_ids"].shape[1]] = -100  # no loss across the samples' boundary
    packed.update(pixel_values=rows["pixel_values"], image_grid_thw=grids, position_ids=torch.cat(positions, dim=2))
    packed.update(videos)
    hf_patches.apply_upipe(model, group)
    out = model(**packed)
    out.loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=group)
            grads[n] = g / dist.get_world_size(group)
    logits = hf_patches.gather_sequence(out.logits.detach(), group)
    return compare((ref_logits, ref_loss.detach(), ref_grads), (logits, out.loss.detach(), grads), 10**6)


def deepcopy_case(group: dist.ProcessGroup) -> dict[str, float]:
    """A copy.deepcopy of a patched VLM encodes with its own tower: its projector zeroed changes its loss, not the
    original's."""
    model = hf_patches.apply_upipe(build_llava(), group)
    sample = llava_sample(0)
    with torch.no_grad():
        before = model(**sample).loss
        clone = copy.deepcopy(model)
        for p in clone.model.multi_modal_projector.parameters():
            p.zero_()
        return {
            "copy_uses_own_tower": float(clone(**sample).loss == before),
            "original_unchanged": float(model(**sample).loss != before),
        }


def refusals(group: dist.ProcessGroup) -> dict[str, str]:
    """apply_upipe's messages for VLMs it does not run exactly."""
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    messages: dict[str, str] = {}
    text = {"model_type": "gemma", **TEXT, "head_dim": 8}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=8)
    paligemma = PaliGemmaForConditionalGeneration(PaliGemmaConfig(text_config=text, vision_config=vision))
    for case, fn in {
        "paligemma": lambda: hf_patches.apply_upipe(paligemma, group),
        "gemma3 packed": lambda: _gemma3_packed(group),
        "gemma3 left padding": lambda: _gemma3_left_padded(group),
        "gemma4 audio": lambda: _gemma4_audio(group),
        "llava_onevision stacked tiles": lambda: _llava_onevision_stacked_tiles(group),
        "ring": lambda: hf_patches.apply_upipe(build_llava(), group, ring_group=group),
        "length": lambda: _odd_length(group),
    }.items():
        try:
            fn()
            messages[case] = "no error"
        except ValueError as err:
            messages[case] = str(err)
    return messages


def _gemma3_packed(group: dist.ProcessGroup) -> None:
    """Gemma 3's image spans with packed rows (positions restarting): refused by name."""
    model = hf_patches.apply_upipe(build_gemma3(), group)
    sample = gemma3_sample(0)
    sample["position_ids"] = torch.cat([torch.arange(24), torch.arange(24)]).expand(2, 48)
    model(**sample)


def _gemma3_left_padded(group: dist.ProcessGroup) -> None:
    """Gemma 3's 2-D mask, carried beside its per-layer masks, is read by UPipe's input check: left padding refused."""
    model = hf_patches.apply_upipe(build_gemma3(), group)
    sample = gemma3_sample(0)
    sample["attention_mask"][0, :2] = 0
    model(**sample)


def _gemma4_audio(group: dist.ProcessGroup) -> None:
    """Gemma 4's audio inputs: refused by name (its audio tower is not shared out)."""
    model = hf_patches.apply_upipe(build_gemma4(), group)
    sample = gemma4_sample(0)
    model(**sample, input_features=torch.zeros(1, 8, 16, dtype=torch.float64), input_features_mask=torch.ones(1, 8))


def _llava_onevision_stacked_tiles(group: dist.ProcessGroup) -> None:
    """LLaVA-OneVision's pixels as all images' tiles stacked ([tiles, C, H, W], which the model takes too): refused
    by name (a share by row would split an image's tiles over ranks)."""
    model = hf_patches.apply_upipe(build_llava_onevision(), group)
    sample = llava_onevision_sample(0)
    tiles = [pixels[:count] for pixels, count in zip(sample["pixel_values"], (1, 1, 1, 5, 3), strict=True)]
    model(**{**sample, "pixel_values": torch.cat(tiles)})


def _odd_length(group: dist.ProcessGroup) -> None:
    model = hf_patches.apply_upipe(build_llava(), group)
    sample = llava_sample(0)
    sample = {k: (v[:, :-1] if k in ("input_ids", "labels") else v) for k, v in sample.items()}
    model(**sample)


def vlm_suite(rank: int, world: int) -> dict[str, Any]:
    """C = 4 over the world, then C = 2 over the pairs {0, 1} and {2, 3}."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    results: dict[str, Any] = {}
    with float64_internals():  # transformers' loss upcasts logits with .float()
        for name in MODELS:
            with float64_internals(integers=name in FLOAT64_INTEGERS):
                results[f"{name} C=4"] = parity_case(name, dist.group.WORLD)
                results[f"{name} C=2"] = parity_case(name, pair)
        for name in VARIANTS:
            with float64_internals(integers=name in FLOAT64_INTEGERS):
                results[f"{name} C=4"] = parity_case(name, dist.group.WORLD)
        for name in CHECKPOINTED:
            results[f"{name} C=2 checkpointing"] = parity_case(name, pair, checkpointing=True)
        for name in STACKED:  # the long-context stack from the ds_config's keys
            results[f"{name} C=2 long-context stack"] = parity_case(name, pair, stack=True)
        results["gemma3 C=4 unfused"] = parity_case("gemma3", dist.group.WORLD, fused_projections=False)
        for name in PACKED:
            results[f"{name} C=4 packed"] = packed_case(name, dist.group.WORLD)
        results["llava C=2 deepcopy"] = deepcopy_case(pair)
    return {"parity": results, "refusals": refusals(pair)}


#: rank 1's Gemma 3 sample in the route case: cut to this many tokens (its loader's batch shorter than rank 0's)
ROUTE_SHORT = 45


def _route_sample(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s batch as its loader gives it: ``gemma3_sample(rank)``, rank 1's cut to ``ROUTE_SHORT``
    tokens (dynamic padding: the route pads it to the group's longest)."""
    sample = gemma3_sample(rank)
    if rank % 2:
        sample = {k: v if k == "pixel_values" else v[:, :ROUTE_SHORT] for k, v in sample.items()}
    return sample


def route_case() -> dict[str, Any]:
    """Gemma 3 through the Trainer / accelerate / TRL routes' loader and loss, SP 2 (DeepSpeed's sequence-parallel
    groups {0, 1} and {2, 3}, as the routes register them), float64: each rank's loader gives its own batch (rank
    1's shorter), ``WholeSamples`` (the routes' eval loaders; the training adapter's ``refill`` runs the same
    ``whole_sample_round``) gives every rank each batch in turn, whole: its ``token_type_ids`` (the image spans)
    whole on every rank (each padded to a multiple of 2 only), ``labels`` replaced by the rank's shard of the
    shifted labels.  One step over the round's
    two micro-batches, each micro-step's loss from ``trainer_sp.sequence_parallel_loss`` (the Trainer's
    ``compute_loss``: the group's token sum over the window's labelled tokens), the gradients averaged over the
    group (the engine's) == the unpatched model on both samples, their losses weighted by labelled tokens.  A
    ValueError or RuntimeError of the route is returned (the same on every rank), not raised."""
    from deepspeed.utils import groups

    from ds_upipe.integration import trainer_sp
    from ds_upipe.integration.sp_setup import sequence_parallel_mpu

    mpu = sequence_parallel_mpu(SP)
    group = mpu.get_sequence_parallel_group()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    model = build_gemma3()
    ref_model = copy.deepcopy(model)
    samples = [_route_sample(r) for r in range(size)]
    ref_model.zero_grad(set_to_none=True)
    counts = [int((hf_patches.shift_labels(s["labels"]) != -100).sum()) for s in samples]
    ref_loss = sum(ref_model(**s).loss * n for s, n in zip(samples, counts)) / sum(counts)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters() if p.grad is not None}

    hf_patches.apply_upipe(model, group)
    loader = hf_patches.sequence_parallel_dataloader([samples[rank]], group, vision_language=True)
    batches = list(loader)
    # each sample padded at the end to a multiple of the group's size (pad_batch), not to the longest
    whole = [torch.nn.functional.pad(s["token_type_ids"], (0, -s["input_ids"].shape[1] % size)) for s in samples]
    result: dict[str, Any] = {
        "token_type_ids_whole": float(all(torch.equal(b["token_type_ids"], w) for b, w in zip(batches, whole))),
        "micro_batches": len(batches),
        "shift_labels_widths": [b["shift_labels"].shape[1] for b in batches],
    }
    before, groups.mpu = groups.mpu, mpu  # the registration's mpu, where trainer_sp finds the group
    try:
        window = sum(trainer_sp._labelled_tokens(b) for b in batches)
        dist.all_reduce(window, group=group)  # window_token_count over the group
        loss = 0.0
        for batch in batches:
            step_loss, _ = trainer_sp.sequence_parallel_loss(model, batch, window, over_all_ranks=False)
            step_loss.backward()
            loss += step_loss.detach()
    except (ValueError, RuntimeError) as err:
        return {**result, "error": f"{type(err).__name__}: {err}"}
    finally:
        groups.mpu = before
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=group)
            grads[n] = g / size
    floor = GRADIENT_FLOOR * max(g.abs().max().item() for g in ref_grads.values())
    return {
        **result,
        "loss": relative_error(loss, ref_loss.detach()),
        "grads": max(relative_error(grads[n], ref_grads[n], floor) for n in ref_grads),
        "grad_names": float(set(grads) != set(ref_grads)),
        "tower_grads_present": float(all(n in grads for n in ref_grads if _is_tower(n))),
    }


# ZeRO-3 through ds_upipe.initialize: SP 2 x DP 2, each replica's whole sample on both of its ranks, a few AdamW
# steps == one process without SP (the tower's gradients averaged by ZeRO-3 over the group, as the text model's)
SP, STEPS = 2, 3
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _zero3_config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},  # every weight partitioned
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "sequence_parallel_size": SP,
        "upipe": {"enabled": True},
    }


def _replica_sample(name: str, step: int, replica: int) -> dict[str, torch.Tensor]:
    """One row of the model's sample per replica and step (equal label counts: the mean of the replicas' losses
    is the mean token loss): Qwen2.5-VL's row 0 (two images), Gemma 3's row 0 (two images a text token apart,
    with its ``token_type_ids``)."""
    if name == "gemma3":
        sample = gemma3_sample(10 * step + replica)
        row = {k: sample[k][:1] for k in ("input_ids", "labels", "token_type_ids", "attention_mask")}
        return {**row, "pixel_values": sample["pixel_values"][:2].float()}
    sample = qwen_sample(10 * step + replica)
    grids = sample["image_grid_thw"]
    first_row = int(grids[:2].prod(-1).sum())  # row 0 holds the first two images
    return {
        "input_ids": sample["input_ids"][:1],
        "labels": sample["labels"][:1],
        "mm_token_type_ids": sample["mm_token_type_ids"][:1],
        "pixel_values": sample["pixel_values"][:first_row].float(),
        "image_grid_thw": grids[:2],
    }


#: the models of the ZeRO-3 case
ZERO3 = ("qwen2_5_vl", "gemma3")


def zero3_case(rank: int, world: int, name: str) -> dict[str, Any]:
    """ZeRO-3 SP 2 x DP 2 vs one process (float32): every step's loss, the first step's gradients (ZeRO-3's,
    averaged over the 4 ranks, before clipping) and the tower's parameters after the steps."""
    import deepspeed.comm as ds_dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    import ds_upipe

    dp, replica = world // SP, rank // SP
    model = MODELS[name][0]().float()
    initial = copy.deepcopy(model.state_dict())
    ref = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(ref.parameters(), **ADAMW)
    ref_losses, ref_grads = [], {}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses = [ref(**_replica_sample(name, step, d)).loss for d in range(dp)]
        torch.stack(losses).mean().backward()
        if step == 0:
            ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        optimizer.step()
        ref_losses.append(losses[replica].item())
    engine, *_ = ds_upipe.initialize(model=model, model_parameters=model.parameters(), config=_zero3_config())
    got, grads = [], {}
    for step in range(STEPS):
        loss = engine(**_replica_sample(name, step, replica)).loss
        engine.backward(loss)
        if step == 0:
            grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
            grads = {n: g.detach().clone() for n, g in grads.items() if g is not None}
        engine.step()
        got.append(loss.item())
    params = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    ds_dist.barrier()
    want = dict(ref.named_parameters())
    tower = [n for n in want if _is_tower(n)]
    floor = GRADIENT_FLOOR * max(g.abs().max().item() for g in ref_grads.values())
    return {
        "losses": max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses)),
        "grads": max(relative_error(grads[n], ref_grads[n], floor) for n in ref_grads),
        "tower_grads": max(relative_error(grads[n], ref_grads[n], floor) for n in ref_grads if n in tower),
        "grad_names": float(not set(ref_grads) <= set(grads)),
        # Adam's update of near-zero gradients (a key bias's) amplifies float32 rounding: reported, not compared
        "tower_params": max(relative_error(params[n], want[n]) for n in tower),
        "params": max(relative_error(params[n], want[n]) for n in want),
        "tower_moved": max((want[n] - initial[n]).abs().max().item() for n in tower),
    }


def tower_memory(group: dist.ProcessGroup, images: int = 8) -> dict[str, int]:
    """Bytes of activations the vision tower and projector keep for backward (saved tensors) on this rank while encoding
    ``images`` 8x8-patch images: shared out over ``group`` vs every rank encoding all (the unpatched encoder)."""
    model = build_qwen2_5_vl()
    ref = copy.deepcopy(model)
    hf_patches.apply_upipe(model, group)
    grids = torch.tensor([[1, 8, 8]] * images)
    pixels = torch.randn(int(grids.prod(-1).sum()), 12, dtype=torch.float64)
    return {
        "shared": _saved_bytes(model, lambda: model.model.get_image_features(pixels, grids)),
        "all": _saved_bytes(ref, lambda: ref.model.get_image_features(pixels, grids)),
    }


def merged_embeddings_freed(group: dist.ProcessGroup) -> dict[str, float]:
    """After the forward (its output held, the backward to come) the whole sample's merged embeddings are gone:
    each rank's text model keeps a copy of its shard, not a view of them (``hf_patches.vlm._shard_merged``).
    With transformers' gradient checkpointing, whose checkpoint of the first layer is its input."""
    model = build_qwen2_5_vl()
    model.gradient_checkpointing_enable()
    model.train()
    hf_patches.apply_upipe(model, group)
    merged: list[weakref.ref] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:  # before the cut to the shard
        merged.append(weakref.ref(kwargs["inputs_embeds"]))

    model.model.language_model.register_forward_pre_hook(record, with_kwargs=True, prepend=True)
    out = model(**qwen_sample(0))
    alive = merged[0]() is not None
    out.loss.backward()
    return {"merged_alive_after_forward": float(alive)}


def _saved_bytes(model: torch.nn.Module, encode: Any) -> int:
    """Bytes of the distinct activations (tensors other than the model's parameters) autograd saves while
    ``encode`` runs."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        encode()
    return sum(seen.values())


#: seconds a collective of the mismatched-sample case's groups waits before gloo fails it: without the same-sample
#: check, the ranks given different samples wait in the tower's collectives until then
MISMATCH_TIMEOUT_S = 30.0


def mismatched_sample_case(rank: int) -> dict[str, Any]:
    """Each pair's rank 1 given another sample than its rank 0 (a video and other ids, as a loader that shards by
    rank would): every rank raises the same-sample check's ValueError, within the groups' timeout; then the same
    sample runs (no rank was left in a collective)."""
    import datetime
    import time

    timeout = datetime.timedelta(seconds=MISMATCH_TIMEOUT_S)
    pairs = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
    model = hf_patches.apply_upipe(build_qwen2_5_vl(), pairs[rank // 2])
    sample = qwen_video_sample(0) if rank % 2 == 0 else qwen_sample(1)
    start = time.monotonic()
    try:
        model(**sample)
        message = "no error"
    except (ValueError, RuntimeError) as err:  # RuntimeError: gloo's timeout, where the check is missing
        message = f"{type(err).__name__}: {err}"
    seconds = time.monotonic() - start
    try:
        with torch.no_grad():
            after = model(**qwen_video_sample(0)).loss.item()
    except RuntimeError:  # the groups timed out before (no check): this rank's result still reaches the test
        after = None
    return {"message": message, "seconds": seconds, "same_sample_loss": after}


def spawn_body(rank: int, world: int) -> dict[str, Any]:
    """The part of the shared spawn of 4 DeepSpeed ranks (tests/four_ranks.py): parity, refusals, the Trainer
    route's loader and loss (Gemma 3), ZeRO-3 and the tower's memory."""
    result = vlm_suite(rank, world)
    result["memory"] = {"C=4": tower_memory(dist.group.WORLD), "merged": merged_embeddings_freed(dist.group.WORLD)}
    with float64_internals():
        result["route"] = route_case()
    result["zero3"] = {name: zero3_case(rank, world, name) for name in ZERO3}
    result["mismatch"] = mismatched_sample_case(rank)  # last: without the check it leaves its groups timed out
    return result
