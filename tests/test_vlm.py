"""Vision-language models under UPipe (hf_patches/vlm.py), in the shared spawn of 4 DeepSpeed ranks
(tests/four_ranks.py, tests/vlm_cases.py): float64 parity with the unpatched model at C = 4 and C = 2, the
refusals, ZeRO-3 training through ds_upipe.initialize (SP 2 x DP 2; Qwen2.5-VL and Gemma 3) against one process,
Gemma 3 through the Trainer / accelerate / TRL routes' loader and loss, the tower's saved activations shared out vs
every rank encoding all; and the share of images each rank encodes."""

from __future__ import annotations

import pytest
import torch

import hf_patches
from hf_patches.vlm import image_share
from tests import vlm_cases

F64 = 1e-10
F32 = 1e-5

REFUSALS = {
    "paligemma": ("PaliGemmaForConditionalGeneration", "bidirectionally", "paligemma"),
    "gemma3 packed": ("bidirectional spans", "packed documents"),
    "gemma3 left padding": ("attention_mask has padding before real tokens",),
    "gemma4 audio": (
        "Gemma4ForConditionalGeneration under UPipe",
        "audio inputs (input_features, input_features_mask)",
    ),
    "llava_onevision stacked tiles": (
        "LlavaOnevisionModel under UPipe: pixel_values of 11 rows for 5 image_sizes",
        "all tiles of an image on one rank",
    ),
    "ring": ("ring_group", "vision-language"),
    "length": ("47 tokens", "multiple of the sequence-parallel size 2"),
}


@pytest.mark.parametrize(("count", "size"), [(3, 2), (3, 4), (8, 4), (0, 2), (1, 4)])
def test_image_shares_cover_every_image_once(count, size):
    shares = [image_share(count, r, size) for r in range(size)]
    assert [i for first, end in shares for i in range(first, end)] == list(range(count))
    assert max(e - f for f, e in shares) - min(e - f for f, e in shares) <= 1


def test_registration_by_name_refuses_vision_language_models():
    """A VLM registered by name or path (its loaders cannot know to give whole samples) is refused when its keys
    reach the model; a model object registered by the Trainer / accelerate / TRL runs (tests/test_trl.py)."""
    from ds_upipe.integration import hf_integration

    settings = hf_integration.upipe_settings({"upipe": {"enabled": True}, "zero_optimization": {"stage": 3}}, 2)
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration is a vision-language model registered by name"):
        hf_integration.refuse_vision_language(vlm_cases.build_llava(), settings, registered=False)
    hf_integration.refuse_vision_language(vlm_cases.build_llava(), settings)  # registered with the object
    alst = hf_integration.upipe_settings({"upipe": {"enabled": False}, "zero_optimization": {"stage": 3}}, 2)
    with pytest.raises(
        ValueError, match=r"LlavaForConditionalGeneration is a vision-language model under DeepSpeed ALST"
    ):
        hf_integration.refuse_vision_language(vlm_cases.build_llava(), alst)
    no_sp = hf_integration.upipe_settings({}, 1)
    hf_integration.refuse_vision_language(vlm_cases.build_llava(), no_sp, registered=False)


def test_long_context_stack_refuses_a_vlm_whose_moe_aux_loss_it_would_drop():
    """Qwen3-VL-MoE adds its router aux loss in its own forward (from its text config): the tiled loss, which replaces
    that forward, refuses it by name; the tiled norms and MLPs are checked as for any text model."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = {**vlm_cases.TEXT, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": 64}
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(text_config=text, vision_config=vision))
    with pytest.raises(ValueError, match="Qwen3VLMoeForConditionalGeneration's router aux loss: a vision-language"):
        hf_patches.check_long_context_stack(model, tiled_loss=True)
    hf_patches.check_long_context_stack(model, tiled_norm=True)


def _ranks(four_deepspeed_ranks):
    return four_deepspeed_ranks["test_vlm.py"]


def test_vlm_parity_c4_and_c2(four_deepspeed_ranks):
    results = _ranks(four_deepspeed_ranks)
    for rank, result in enumerate(results):
        packed, checkpointed = len(vlm_cases.PACKED), len(vlm_cases.CHECKPOINTED)
        stacked, variants = len(vlm_cases.STACKED), len(vlm_cases.VARIANTS)
        # + the deepcopy case and Gemma 3 unfused
        assert len(result["parity"]) == 2 * len(vlm_cases.MODELS) + packed + checkpointed + stacked + variants + 2
        for case, errors in result["parity"].items():
            assert max(errors.values()) <= F64, f"rank {rank} {case}: {errors}"


def test_vlm_refusals(four_deepspeed_ranks):
    results = _ranks(four_deepspeed_ranks)
    for rank, result in enumerate(results):
        messages = result["refusals"]
        assert messages == results[rank // 2 * 2]["refusals"], "both ranks of a pair raise the same errors"
        for case, words in REFUSALS.items():
            for word in words:
                assert word in messages[case], f"{case}: {messages[case]!r} lacks {word!r}"


def test_vlm_ranks_given_different_samples_raise_instead_of_hanging(four_deepspeed_ranks):
    """Each pair's rank 1 given another sample (other ids, no video): every rank of both pairs raises the same-sample
    check's ValueError naming what differs, long before the groups' collective timeout (without the check the
    ranks wait in the tower's collectives until gloo's timeout fails them); the group then runs a same sample."""
    results = _ranks(four_deepspeed_ranks)
    for rank, result in enumerate(results):
        r = result["mismatch"]
        message = r["message"]
        for words in (
            "ValueError: Qwen2_5_VLForConditionalGeneration under UPipe: rank 1's sample differs from rank 0's",
            "input_ids contents differ on ranks [1]",
            "pixel_values_videos shape per rank [(32, 12), 'absent']",
            "video_grid_thw shape per rank [(1, 3), 'absent']",
            "every rank of the sequence-parallel group must pass the whole sample",
        ):
            assert words.lower() in message.lower(), f"rank {rank}: {message!r} lacks {words!r}"
        assert message == results[0]["mismatch"]["message"], "every rank raises the same error"
        assert r["seconds"] < vlm_cases.MISMATCH_TIMEOUT_S / 3, f"rank {rank}: {r}"
        assert r["same_sample_loss"] == pytest.approx(results[0]["mismatch"]["same_sample_loss"], rel=1e-12), r


@pytest.mark.parametrize("name", vlm_cases.ZERO3)
def test_vlm_zero3_training_equals_one_process(four_deepspeed_ranks, name):
    for rank, result in enumerate(_ranks(four_deepspeed_ranks)):
        r = result["zero3"][name]
        assert max(r["losses"], r["grads"], r["tower_grads"]) <= F32, f"rank {rank}: {r}"
        assert r["grad_names"] == 0, f"rank {rank}: {r}"
        assert r["tower_moved"] > 1e-4, f"rank {rank}: the steps must move the tower: {r}"


def test_gemma3_through_the_trainer_route_keeps_token_type_ids_whole(four_deepspeed_ranks):
    """Gemma 3's batches through the Trainer / accelerate / TRL routes' loader (``WholeSamples``): every rank's
    micro-batch holds the whole sample's ``token_type_ids`` (its image spans) and its shard of the shifted labels
    (rank 1's sample of 45 tokens padded to 46: 23 a rank);
    one step of the round through ``trainer_sp.sequence_parallel_loss`` == the unpatched model (float64)."""
    for rank, result in enumerate(_ranks(four_deepspeed_ranks)):
        r = result["route"]
        assert r["token_type_ids_whole"] == 1.0, f"rank {rank}: {r}"
        assert r["micro_batches"] == 2 and r["shift_labels_widths"] == [24, 23], f"rank {rank}: {r}"
        assert "error" not in r, f"rank {rank}: {r}"
        assert max(r["loss"], r["grads"]) <= F64, f"rank {rank}: {r}"
        assert r["grad_names"] == 0 and r["tower_grads_present"] == 1.0, f"rank {rank}: {r}"


def test_vlm_tower_memory_shared_out(four_deepspeed_ranks):
    """8 equal images over 4 ranks: each rank's tower keeps a quarter of what encoding all of them keeps."""
    for rank, result in enumerate(_ranks(four_deepspeed_ranks)):
        memory = result["memory"]["C=4"]
        assert memory["shared"] * 4 == pytest.approx(memory["all"], rel=0.05), f"rank {rank}: {memory}"
        # the whole merged sample is not kept for the backward (the planner counts it in the forward only)
        assert result["memory"]["merged"]["merged_alive_after_forward"] == 0.0, f"rank {rank}"


def test_vision_language_batches_are_padded_along_the_sequence_only():
    """A whole VLM sample padded for the loaders: input_ids / labels / attention_mask / mm_token_type_ids to a
    multiple, the images, grids (a patch row as wide as the sequence here) untouched, no position_ids added; each
    rank's micro-batch keeps them whole with its shard of the shifted labels."""
    from hf_patches.data import pad_batch, vision_language_micro_batch

    sample = vlm_cases.qwen_sample(0)
    sample = {k: v[:, :12] if v.shape[-1] == 24 else v for k, v in sample.items()}  # 12 tokens, 12-wide patches
    sample["attention_mask"] = torch.ones_like(sample["input_ids"])
    padded = pad_batch(sample, 8, vision_language=True)
    assert padded["input_ids"].shape == (2, 16) and padded["mm_token_type_ids"].shape == (2, 16)
    assert (padded["labels"][:, 12:] == -100).all() and (padded["attention_mask"][:, 12:] == 0).all()
    assert "position_ids" not in padded
    for key in ("pixel_values", "image_grid_thw"):
        assert torch.equal(padded[key], sample[key]), key
    shards = [vision_language_micro_batch(padded, r, 2, torch.device("cpu")) for r in range(2)]
    whole = hf_patches.shift_labels(padded["labels"])
    assert torch.equal(torch.cat([s["shift_labels"] for s in shards], dim=1), whole)
    assert all("labels" not in s and torch.equal(s["pixel_values"], sample["pixel_values"]) for s in shards)
