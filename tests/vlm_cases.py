"""Rank-side bodies of tests/test_vlm.py: tiny vision-language models (Qwen2.5-VL, Qwen3-VL, LLaVA) patched by
``apply_upipe`` against the same model unpatched in one process, float64: logits, loss and every gradient
(the vision tower's and projector's included), with images across the shard boundaries and shares of images
that are uneven or empty.  One spawn of 4 ranks runs C = 4 and C = 2 (two pairs)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

import hf_patches
from ds_upipe.tools.parity import compare, float64_internals

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


def build_qwen3_vl(seed: int = 0) -> torch.nn.Module:
    """Qwen3-VL: as Qwen2.5-VL's, with interleaved mrope and deepstack features of both vision blocks added to
    the first two decoder layers' visual tokens."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    rope = {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0, "mrope_interleaved": True}
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=4,
        patch_size=2,
        temporal_patch_size=1,
        spatial_merge_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    )
    config = Qwen3VLConfig(
        text_config={**TEXT, "head_dim": 8, "rope_parameters": rope},
        vision_config=vision,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
    )
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).double()


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


def llava_sample(seed: int) -> dict[str, torch.Tensor]:
    """One row of 48 tokens, two images of 16 tokens: the second crosses the C = 2 boundary (24), both cross
    a C = 4 one (12, 24)."""
    sample = _tokens(1, 48, [(0, 2, 16), (0, 20, 16)], seed)
    gen = torch.Generator().manual_seed(seed + 1)
    sample["pixel_values"] = torch.randn(2, 3, 8, 8, generator=gen, dtype=torch.float64)
    return sample


MODELS = {
    "qwen2_5_vl": (build_qwen2_5_vl, qwen_sample),
    "qwen3_vl": (build_qwen3_vl, qwen_sample),
    "llava": (build_llava, llava_sample),
}


def parity_case(name: str, group: dist.ProcessGroup, seed: int = 0) -> dict[str, float]:
    """The patched VLM given the whole sample on every rank == the unpatched VLM (float64).  The patched
    loss's gradients are for a group that averages them (``sequence_parallel_loss``'s "mean"): the sum over
    the group divided by its size is compared."""
    build, make = MODELS[name]
    model = build(seed)
    ref_model = copy.deepcopy(model)
    sample = make(seed)
    ref_model.zero_grad(set_to_none=True)
    ref = ref_model(**sample)
    ref.loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters() if p.grad is not None}

    hf_patches.apply_upipe(model, group)
    out = model(**sample)
    out.loss.backward()
    size = dist.get_world_size(group)
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=group)
            grads[n] = g / size
    logits = hf_patches.gather_sequence(out.logits.detach(), group)
    errors = compare((ref.logits.detach(), ref.loss.detach(), ref_grads), (logits, out.loss.detach(), grads), 10**6)
    tower = [n for n in ref_grads if "visual" in n or "vision_tower" in n or "projector" in n]
    errors["tower_grads_present"] = float(not tower or any(n not in grads for n in tower))
    errors["tower_attention"] = float(model.config.vision_config._attn_implementation != "sdpa")
    return errors


def refusals(group: dist.ProcessGroup) -> dict[str, str]:
    """apply_upipe's messages for VLMs it does not run exactly."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    messages: dict[str, str] = {}
    text = {**TEXT, "head_dim": 8, "sliding_window": 4, "final_logit_softcapping": None}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=8)
    gemma = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))
    for case, fn in {
        "gemma3": lambda: hf_patches.apply_upipe(gemma, group),
        "ring": lambda: hf_patches.apply_upipe(build_llava(), group, ring_group=group),
        "length": lambda: _odd_length(group),
    }.items():
        try:
            fn()
            messages[case] = "no error"
        except ValueError as err:
            messages[case] = str(err)
    return messages


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
            results[f"{name} C=4"] = parity_case(name, dist.group.WORLD)
            results[f"{name} C=2"] = parity_case(name, pair)
    return {"parity": results, "refusals": refusals(pair)}
