"""Sequence-parallel DPO and GRPO (hf_patches.rl_loss, hf_patches.logprobs) equal TRL's non-SP
definitions: float64, tiny Llama models, in-process ranks over gloo, one spawn per group size (rank
bodies and the reference in tests/rl_cases.py).  The C=4 cases (DPO sigmoid, GRPO "grpo" with
sequence-level weights) run in test_hf_parity's spawn of four.

Per case, on every rank: the loss, the per-row summed completion log-probs (policy and reference) and
every parameter gradient (averaged over the ranks, as DeepSpeed does) within 1e-10 relative of the
non-SP computation on the whole rows; the log-probs also within 1e-5 of TRL's own fused LM head (which
computes in float32).  Cases: DPO sigmoid (reference model patched, a deepcopy of the patched model),
IPO with precomputed reference log-probs, hinge untiled; GRPO's "dapo", "grpo" (sequence-level
importance weights, two-sided clipping), "bnpo" without KL and "dr_grpo"; rows of different lengths,
prompt masks, left-padded GRPO prompts, shard padding (row lengths not a multiple of C).

Mutations that fail them: ``group_sum`` averaging instead of summing (every case, errors 1e-2 to 29);
``group_sum`` as the value-of-the-sum, gradient-of-the-local-part trick of ``loss.py`` (the nested
reduction of "dr_grpo" with sequence-level weights: gradient error 1.2).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from ds_upipe.tools.ranks import run_ranks  # noqa: E402
from tests import rl_cases  # noqa: E402


def test_rl_losses_equal_no_sp_c2_and_memory():
    """C=2, and the peak memory of the log-prob computation: per rank under UPipe vs one process."""
    results = run_ranks(rl_cases.cases, 2)
    rl_cases.check_cases([r["cases"] for r in results], 2)
    for peaks in (r["memory"] for r in results):
        # measured: whole rows 107.1 MiB (logits) / 24.6 (tiled); per rank at C=2 54.2 / 13.5
        assert peaks["sp_logits"] < 0.55 * peaks["no_sp_logits"], peaks
        assert peaks["sp_tiled"] < 0.6 * peaks["no_sp_tiled"], peaks
        assert peaks["sp_tiled"] < 0.3 * peaks["sp_logits"], peaks
