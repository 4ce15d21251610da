"""Hybrid models on the DeepSpeed engine route: ``ds_upipe.initialize`` with a tiny Qwen3.5 (gated delta net +
gated attention) and a tiny Nemotron-H (Mamba-2 + attention + MLP) at ZeRO-3 (every parameter partitioned),
SP 2 x DP 2, with and without activation checkpointing: three AdamW steps (gradient clipping on) give the
losses and parameters of the same model trained in one process without SP; the mixers' weights read outside
their submodules are registered with ZeRO-3 by apply_upipe (``zero3_params``), not left to DeepSpeed's
getter discovery; and the ds_config's mixer refusals come on every rank before the groups are built.

Cases: tests/hybrid_engine_cases.py, run in the shared spawn of 4 DeepSpeed ranks (tests/four_ranks.py).

Tolerance: float32 (the models are float32; transformers computes parts in float32 anyway: RMSNorms,
A_log's exp, Nemotron-H's logits).  The SP run sums the same terms in another order (tokens split over
ranks, gradients reduce-scattered over 4 ranks), so losses agree to float32 rounding (measured 1.0e-7
relative) and parameters after three Adam steps to 1.6e-6 of each tensor's largest value: Adam divides each
gradient element by its own magnitude, so an element's rounding shows in the update relative to that element,
not to the tensor.  Bounds: 1e-5 for both."""

from __future__ import annotations

from tests import hybrid_engine_cases as cases

TOLERANCE = 1e-5


def _ranks(four_deepspeed_ranks):
    return four_deepspeed_ranks["test_hybrid_engine.py"]


def test_zero3_training_equals_one_process(four_deepspeed_ranks):
    for rank, result in enumerate(_ranks(four_deepspeed_ranks)):
        assert set(result["zero3"]) == set(cases.ZERO3_CASES)
        for name, r in result["zero3"].items():
            where = f"rank {rank} {name}: {r}"
            assert max(r["eval_logits"], r["losses"], r["params"]) <= TOLERANCE, where
            assert r["param_names"] == 0, where
            # the steps moved the parameters by about 3 x lr (a run that never stepped would not match)
            assert r["moved"] > 1e-3, where
            family, checkpointing, upipe = cases.ZERO3_CASES[name]
            assert r["checkpointing"] == ("reentrant" if checkpointing else None), where
            expected_u = upipe.get("mixer_head_chunk_size")
            assert r["mixer_u"] == (8 if expected_u == "auto" else expected_u), where  # "auto": every U fits


def test_mixer_weights_registered_with_zero3(four_deepspeed_ranks):
    """Every partitioned weight a patched mixer reads outside its submodules was registered by apply_upipe
    (gated delta: in_proj_qkv, in_proj_b, in_proj_a, conv1d; Mamba-2: in_proj and conv1d weights and biases,
    2 mixers): DeepSpeed's getter had nothing left to discover in the eager forwards.  Without the registration
    the numbers stay right in eager mode (the getter gathers and registers them), but not under torch.compile,
    where the getter hands out the partitioned parameter as it is."""
    for rank, result in enumerate(_ranks(four_deepspeed_ranks)):
        for name, r in result["zero3"].items():
            expected = 4 if name.startswith("qwen3_5") else 8
            assert (r["registered"], r["discovered"]) == (expected, 0), f"rank {rank} {name}: {r}"


def test_mixer_refusals_before_any_collective(four_deepspeed_ranks):
    """The same ValueError on every rank, raised by the model check that runs before DeepSpeed's groups are
    built (check_model_settings: named by the ds_config key), and the ranks go on to a valid initialize."""
    results = [r["refusals"] for r in _ranks(four_deepspeed_ranks)]
    expected = {
        "gated_delta_u": (
            "invalid ds_config: upipe.mixer_head_chunk_size=3: apply_upipe: decoder layer 0 (Qwen3_5GatedDeltaNet)",
            "Valid values: 2, 4, 8",
        ),
        "mamba2_u": (
            "invalid ds_config: upipe.mixer_head_chunk_size=6: apply_upipe: decoder layer 0 (NemotronHMamba2Mixer)",
            "Valid values: 2, 4, 8",
        ),
        "ring": ("invalid ds_config: upipe.ring_size=2: apply_upipe: decoder layer 0 (Qwen3_5GatedDeltaNet)", "Ring"),
    }
    for rank, result in enumerate(results):
        assert result == results[0], f"rank {rank} differs: {result} vs {results[0]}"
        for name, (start, part) in expected.items():
            assert result[name] is not None and result[name].startswith(start) and part in result[name], result
            assert result[f"{name}:groups_unchanged"], (name, result)
        assert result["valid"] == 2, result
