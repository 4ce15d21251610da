"""Config and training-data errors of ds_upipe.initialize: each one a ValueError naming the key or the
data, raised identically on every rank (2 gloo ranks, one spawn for all cases)."""

import ast
import re

import pytest

from ds_upipe.schedule import valid_head_chunk_sizes
from ds_upipe.tools.ranks import run_ranks
from tests import engine_cases

EXPECTED = {  # case -> pieces every rank's message must contain
    "unknown_key": ["upipe.chunk: unknown key", "allowed keys: enabled, head_chunk_size"],
    "bad_head_chunk_size": ["upipe.head_chunk_size", f"Valid values: {valid_head_chunk_sizes(8, 2, 2)}"],
    "head_chunk_size_type": ["upipe.head_chunk_size: got 'big'", '"auto"'],
    "auto_without_budget": ["upipe.memory_budget_gib", "upipe.seq_length"],
    "sp_not_dividing_world": ["sequence_parallel_size: got 3 for a world of 2", "[1, 2]"],
    "heads_incompatible": ["sequence_parallel_size: got 2", "num_attention_heads=6, num_key_value_heads=3"],
    "heads_incompatible_alst": ["sequence_parallel_size: got 2", "num_attention_heads=6, num_key_value_heads=3"],
    "partition_activations": ["activation_checkpointing.partition_activations", "allowed: false"],
    "zero_stage_0": ["zero_optimization.stage: got 0", "allowed: 1, 2 or 3"],
    "data_parallel_size": ["data_parallel_size: got 2", "allowed: 1"],
    "not_hf_model": ["HuggingFace transformers model", "Linear"],
    "ring_not_dividing_sp": ["upipe.ring_size: got 3 for sequence_parallel_size=2", "[1, 2]"],
    "ring_size_zero": ["upipe.ring_size: got 0", "an int >= 1 that divides sequence_parallel_size"],
    "ring_with_alst": ["upipe.ring_size: got 2 with upipe.enabled=false", "no ring attention"],
    "ring_head_chunk_size": [
        "upipe.head_chunk_size",
        f"Valid values: {valid_head_chunk_sizes(8, 2, 1)}",
        "with upipe.ring_size=2 the heads are split over the Ulysses degree",
    ],
    "tiled_loss_without_lm_head": [
        "upipe.tiled_loss/tiled_norm/tiled_mlp",
        "tiled_loss=True needs a causal LM",
        "LlamaModel",
    ],
    "tiled_mlp_bad_tile": ["upipe.tiled_mlp: got {'tile_tokens': 0}; allowed: true, false, or"],
    "hybrid_with_alst": ["upipe.enabled: got false", "NemotronHMamba2Mixer", '"upipe": {"enabled": true}'],
    "hybrid_mixer_head_chunk_size": [
        "upipe.mixer_head_chunk_size=3: apply_upipe: decoder layer 0 (Qwen3_5GatedDeltaNet)",
        "mixer_head_chunk_size=3",
        "Valid values: 2, 4",
    ],
}
RANKS_EXPECTED = {  # rank 1's config differs from rank 0's: the same error on both, naming per-rank values
    "sequence_parallel_size": ["ds_config settings differ across ranks: sequence_parallel_size per rank [2, 1]"],
    "enabled": ["upipe.enabled per rank [True, False]"],
    "tiled_loss": ["upipe.tiled_loss per rank [False, True]"],
    "offload_checkpoints": ["upipe.offload_checkpoints per rank [False, True]"],
    "ring_size": ["upipe.ring_size per rank [1, 2]"],
    "invalid_on_one_rank": ["invalid ds_config: upipe.chunk: unknown key", "(raised on rank 1; the ranks' ds_configs"],
}
PAD_HOW = ["Pad every sample to one length L", "DataCollatorForSeq2Seq", "hf_patches.pad_batch(default_collate"]
LOADER_EXPECTED = {
    # the loader gives rank 0 and rank 1 different samples (8, 10, 12 or 14 tokens; shuffled, seed 0)
    "batch_of_different_lengths": [
        "could not build this step's batches on every rank of the sequence-parallel group (rank 0: RuntimeError: "
        "stack expects each tensor to be equal size",
        "; rank 1: RuntimeError: stack expects each tensor to be equal size",
        *PAD_HOW,
    ],
    "no_labels": [
        "every training batch must be a dict (mapping) with input_ids and labels",
        "got keys rank 0: ['input_ids']; rank 1: ['input_ids']",
    ],
}


@pytest.fixture(scope="module")
def results():
    assert set(EXPECTED) == set(engine_cases.ERROR_CASES)
    assert set(LOADER_EXPECTED) | {"samples_of_different_lengths"} == set(engine_cases.LOADER_CASES)
    assert set(RANKS_EXPECTED) == set(engine_cases.RANK_MISMATCH_CASES)
    return run_ranks(engine_cases.config_errors, 2, use_deepspeed=True, timeout=300)


def _check(results, expected, prefix=""):
    for rank, out in enumerate(results):
        for case, pieces in expected.items():
            msg = out[prefix + case]
            assert msg is not None, f"rank {rank}: {case} raised no ValueError"
            for piece in pieces:
                assert piece in msg, f"rank {rank}: {case}: {piece!r} not in {msg!r}"


def test_config_errors_raised_on_every_rank(results):
    _check(results, EXPECTED)
    for out in results:
        assert out["valid_head_chunk_size"] == 2  # null -> U = C, after all the refused configs
    differ = {k for k in results[0] if results[0][k] != results[1][k]}
    assert differ == {"loader:samples_of_different_lengths"}, (
        differ
    )  # the same errors, word for word (that one: shards)
    assert all(re.match(r"invalid ds_config|sequence_parallel_size > 1 needs", results[0][c]) for c in EXPECTED)


def test_configs_that_differ_across_ranks_raise_on_every_rank(results):
    """Used to hang in new_group, a ZeRO-3 fetch or the input check, or abort gloo ("collective mismatch")."""
    _check(results, RANKS_EXPECTED, prefix="ranks:")
    for case in RANKS_EXPECTED:
        assert results[0][f"ranks:{case}"] == results[1][f"ranks:{case}"], case


def test_accelerate_route_exchanges_the_same_settings(results):
    """hf_integration's registration (the Trainer / accelerate route) runs the same exchange before the
    registration's first collective: the same errors, word for word, as ds_upipe.initialize's."""
    _check(results, RANKS_EXPECTED, prefix="accelerate:")
    for case in RANKS_EXPECTED:
        assert results[0][f"accelerate:{case}"] == results[1][f"accelerate:{case}"] == results[0][f"ranks:{case}"]


def test_training_data_errors_raised_on_every_rank(results):
    _check(results, LOADER_EXPECTED, prefix="loader:")
    # samples of different lengths on the two ranks (TRL's dynamic padding): both padded to the longer,
    # each rank holding its half of it (gloo cannot all_gather tensors of different sizes)
    shards = [
        ast.literal_eval(out["loader:samples_of_different_lengths"].removeprefix("accepted: ")) for out in results
    ]
    (first,), (second,) = shards
    assert len(first) == len(second) and first[0] == 0 and second[0] == first[-1] + 1, shards
    assert 2 * len(first) in (10, 12, 14), shards  # the longer of two different lengths from 8, 10, 12, 14
