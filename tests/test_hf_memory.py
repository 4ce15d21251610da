"""Peak activation memory per rank (MemTracker, forward + backward, float32, C=4, H=32, KV=8): fused
UPipe at U = C (with and without recompute_attention_output) against DeepSpeed ALST's
UlyssesSPAttentionHF on the same model, and with ``accumulate_dtype: "input"`` (keys "+input": dK/dV per
stage, no round-sized accumulator)."""


def test_fused_upipe_vs_alst(four_deepspeed_ranks):
    # hf_cases.memory_case on 4 ranks (the spawn shared with other files: tests/four_ranks.py)
    results = four_deepspeed_ranks["test_hf_memory.py"]
    print({key: round(units, 3) for key, units in results[0].items()})
    for rank, units in enumerate(results):
        assert units == results[0], "MemTracker is deterministic and the ranks are symmetric"
        fused_block, alst_block = units[("upipe_fused", "attention")], units[("alst", "attention")]
        fused_layer, alst_layer = units[("upipe_fused", "layer")], units[("alst", "layer")]
        recompute_block = units[("upipe_fused_recompute", "attention")]
        recompute_layer = units[("upipe_fused_recompute", "layer")]
        # accumulate_dtype "input" (the long-context config's): dK/dV per stage, no round-sized accumulator;
        # measured 0.689 (6.383 vs 9.258 units) with the materialized output gradient (issue 11 aims at 0.60;
        # the floor is x, dy, the block output, the saved attention output and dx: 5 units, docs/benchmarks.md)
        input_block = units[("upipe_fused+input", "attention")]
        assert input_block <= 0.70 * alst_block, f"rank {rank}: attention block {input_block} vs ALST {alst_block}"
        # the default sums dK/dV per round (one product through K's and V's projections per round, not per
        # stage): the round's dK and dV accumulator, 2 stage units (0.25 hidden states here), sits beside the
        # kernel's backward. Measured 6.633 (0.716); the decoder layer's peak is elsewhere (unchanged)
        assert input_block < fused_block <= 0.72 * alst_block, f"rank {rank}: {fused_block} vs {input_block}"
        assert fused_layer < alst_layer, f"rank {rank}: decoder layer {fused_layer} vs ALST {alst_layer}"
        # recompute_attention_output keeps no attention output from forward to backward: measured 0.583
        # (5.399 vs 9.258 units) with "input", 0.610 (5.649) with per-round dK/dV; its layer 14.078 vs the
        # plain fused layer's 15.203
        recompute_input = units[("upipe_fused_recompute+input", "attention")]
        assert recompute_input <= 0.60 * alst_block, f"rank {rank}: recompute block {recompute_input} vs {alst_block}"
        assert recompute_input < recompute_block <= 0.62 * alst_block, f"rank {rank}: {recompute_block}"
        assert recompute_layer < fused_layer, f"rank {rank}: recompute layer {recompute_layer} vs fused {fused_layer}"
        assert alst_block > 4, alst_block  # ALST's gathered q/k/v/output: a real baseline, not a no-op
