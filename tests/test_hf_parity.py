"""hf_patches: patched Llama/Mistral/Qwen2/Qwen3 on sequence shards == the unpatched model on the
whole sequence (logits, loss, parameter gradients summed over ranks), plus padding, base models,
save/reload, HF gradient checkpointing, PEFT LoRA fallback, right-padding masks, and refusals."""

import pytest

from ds_upipe.tools import sweep
from ds_upipe.tools.ranks import run_ranks
from tests import family_cases, hf_cases, rl_cases

F64 = hf_cases.TOLERANCE[hf_cases.torch.float64]
NUM_PARITY_CASES = 2 * len(hf_cases.ARCH_CONFIGS) + 11

#: ds_upipe.validation.check_settings: the one cross-rank settings message of every route
DIFFERS = "differs across the ranks of the sequence-parallel group ("
REFUSALS = {  # case -> words its message must contain (the offending value and the rule)
    "mistral_sliding_window_zero": ["MistralAttention.sliding_window must be a positive int", "got 0"],
    "unsupported_arch": ["BertModel is bidirectional", "BertSelfAttention.is_causal=False"],
    "refuse_softcapping": ["config.attn_logit_softcapping=50.0", "not supported"],
    "refuse_linear_attention": [
        "decoder layer 0 (MiniMaxDecoderLayer)",
        "MiniMaxLightningAttention is a sequence mixer",
    ],
    "refuse_chunked": ["config.attention_chunk_size=8", "chunked attention"],
    "refuse_layer_kv_heads": ["decoder layer 1 (12 query and 4 key/value heads", "each runs its own stage plan"]
    + ["invalid head_chunk_size=4", "(GQA group size 3)"],
    "refuse_hybrid_ssm": ["decoder layer 0 is 'hybrid'", "UPipe runs the layer types"],
    "refuse_encoder_decoder": ["T5ForConditionalGeneration is an encoder-decoder model"],
    "refuse_dropout_gpt2": ["decoder layer 0 (GPT2Attention)", "attention dropout 0.1 (config.attn_pdrop)"]
    + ["set config.attn_pdrop=0.0"],
    "bad_head_chunk": ["head_chunk_size=3", "Valid values"],
    "moe_aux_loss": [
        "Qwen3MoeForCausalLM: output_router_logits=True",
        "sequence shard only",
        "Pass output_router_logits=False",
    ],
    "moe_aux_loss_config": ["Qwen3MoeForCausalLM: output_router_logits=True", "router_aux_loss_coef="],
    "attention_dropout": ["attention dropout 0.1 (config.attention_dropout)", "set config.attention_dropout=0.0"],
    "recompute_unfused": ["recompute_attention_output=True needs fused_projections=True"]
    + ["set fused_projections=True or recompute_attention_output=False"],
    "double_patch": ["already patched"],
    "no_position_ids": ["position_ids are required", "[0, 1]"],
    "left_padding": ["left padding", "right padding"],
    "mask_4d": ["attention_mask", "2-D"],
    "use_cache": ["use_cache=True", "generation (KV cache / incremental decoding) is not supported"],
    "generate": ["LlamaForCausalLM.generate()", "generation (KV cache / incremental decoding) is not supported"]
    + ["without sequence parallelism", "attn_implementation='sdpa'"],
    "rank_head_chunk": [f"head_chunk_size {DIFFERS}rank 0: 2, rank 1: 4)", "every rank must build UPipe"],
    "rank_flags": [f"fused_projections {DIFFERS}rank 0: True, rank 1: False)"]
    + [f"overlap_comm {DIFFERS}rank 0: False, rank 1: True)"]
    + [f"accumulate_in_input_dtype {DIFFERS}rank 0: True, rank 1: False)"]
    + [f"recompute_attention_output {DIFFERS}rank 0: True, rank 1: False)"]
    + [f"share_exchanged_kv {DIFFERS}rank 0: False, rank 1: True)"],
    "generate_use_cache": ["Qwen2ForCausalLM.generate()", "is not supported under UPipe sequence parallelism"],
    "uneven_shards": ["[5, 4]", "equal"],
}


NUM_PACKED_CASES = {2: 7, 4: 5}  # Qwen3 at C=2 only


def _check_packed(results, world):
    """Packed rows (DataCollatorWithFlattening) == every document alone in one process, float64."""
    for rank, cases in enumerate(results):
        assert len(cases) == NUM_PACKED_CASES[world]
        for case, errors in cases.items():
            assert max(errors.values()) <= F64, f"C={world} rank {rank} packed {case}: {errors}"


#: families whose norms compute in float32 inside a float64 model (Gemma3RMSNorm upcasts with x.float()): the
#: sharded and whole-sequence runs round those float32 values differently (measured 1e-7 to 2e-7)
FLOAT32_NORM_FAMILIES = ("gemma3",)


def _check_families(results, world):
    """tests/family_cases.py: the families (4 of multi-head latent attention; Gemma 4 also with per-layer key/value
    heads, a stage plan per layer's heads), fused and unfused, U = C and H, windows, packing, checkpointing, a 2 x 2
    ring (C = 4): logits, loss and every gradient (sinks, routers) equal the unpatched model."""
    for rank, cases in enumerate(results):
        assert len(cases) == family_cases.num_family_cases(world)
        for case, errors in cases.items():
            tol = hf_cases.TOLERANCE[
                hf_cases.torch.float32 if case.startswith(FLOAT32_NORM_FAMILIES) else hf_cases.torch.float64
            ]
            # a family computing a part in float32 on purpose: the sweep's tolerance for it (one table)
            tol = next((t for f, (t, _) in sweep.TOLERANCES.items() if case.startswith(f"{f}_")), tol)
            assert max(errors.values()) <= tol, f"C={world} rank {rank} {case}: {errors}"


def _check_parity(results, world):
    for rank, (failures, count, stage_runs) in enumerate(results):
        assert count == NUM_PARITY_CASES
        assert not failures, f"C={world} rank {rank}: {failures}"
        assert stage_runs > 0  # ds_upipe.pipeline.StageCounter: UPipe's stage loop ran


def test_group_of_two():
    results = run_ranks(hf_cases.c2_group, 2)
    _check_families([r["families"] for r in results], 2)
    _check_parity([r["parity"] for r in results], 2)
    _check_packed([r["packed"] for r in results], 2)
    for rank, r in enumerate(results):
        for case, errors in r["misc"].items():
            assert max(errors.values()) <= F64, f"rank {rank} {case}: {errors}"
        messages = r["refusals"]
        assert messages == results[0]["refusals"], "every rank must raise the same errors"
        for case, words in REFUSALS.items():
            for word in words:
                assert word in messages[case], f"{case}: {messages[case]!r} lacks {word!r}"
        assert messages["still_works"] == "(1, 4, 101)"


@pytest.mark.parametrize("world", [4])
def test_group_of_four(world):
    results = run_ranks(hf_cases.group_of_four, world)
    _check_families([r["families"] for r in results], world)
    _check_parity([r["parity"] for r in results], world)
    _check_packed([r["packed"] for r in results], world)
    if results[0]["rl"] is not None:  # sequence-parallel DPO / GRPO at C=4 (tests/test_rl.py has C=2)
        rl_cases.check_cases([r["rl"] for r in results], world)


def test_rope_scaling():
    """Dynamic, longrope, yarn, llama3 and linear RoPE at C=4 and C=2 (one spawn of 4 ranks), with
    shards that stay below the scaling threshold while the whole sequence exceeds it."""
    results = run_ranks(hf_cases.rope_cases, 4)
    for rank, (failures, count) in enumerate(results):
        assert count == 2 * 2 * len(hf_cases.ROPE_CASES)
        assert not failures, f"rank {rank}: {failures}"


RING_LAYOUTS = ((2, 2), (1, 4))  # C_u x R: UPipe x Ring, and ring only


def test_ring_2x2_and_1x4():
    """UPipe x Ring through apply_upipe (ring_group) on zigzag shards (shard_batch / the data loader
    with ring_size): logits, loss and all gradients equal the single-process model at float64."""
    results = run_ranks(hf_cases.ring_suite, 4, RING_LAYOUTS, use_deepspeed=True)
    for rank, by_layout in enumerate(results):
        for layout in RING_LAYOUTS:
            cases = by_layout[layout]
            assert len(cases) == len(hf_cases.ring_cases_for(layout)) + 2  # + data loader, packed refusal
            for case, errors in cases.items():
                assert max(errors.values()) <= F64, f"rank {rank} C_u x R = {layout} {case}: {errors}"
