"""Vision-language models under UPipe (hf_patches/vlm.py): float64 parity with the unpatched model at C = 4
and C = 2 (one spawn, tests/vlm_cases.py), the refusals, and the share of images each rank encodes."""

from __future__ import annotations

import pytest

from ds_upipe.tools.ranks import run_ranks
from hf_patches.vlm import image_share
from tests import vlm_cases

F64 = 1e-10

REFUSALS = {
    "gemma3": ("Gemma3ForConditionalGeneration", "bidirectionally", "causal"),
    "ring": ("ring_group", "vision-language"),
    "length": ("47 tokens", "multiple of the sequence-parallel size 2"),
}


@pytest.mark.parametrize(("count", "size"), [(3, 2), (3, 4), (8, 4), (0, 2), (1, 4)])
def test_image_shares_cover_every_image_once(count, size):
    shares = [image_share(count, r, size) for r in range(size)]
    assert [i for first, end in shares for i in range(first, end)] == list(range(count))
    assert max(e - f for f, e in shares) - min(e - f for f, e in shares) <= 1


def test_vlm_parity_c4_and_c2():
    results = run_ranks(vlm_cases.vlm_suite, 4)
    for rank, result in enumerate(results):
        assert len(result["parity"]) == 2 * len(vlm_cases.MODELS)
        for case, errors in result["parity"].items():
            assert max(errors.values()) <= F64, f"rank {rank} {case}: {errors}"
        messages = result["refusals"]
        assert messages == results[rank // 2 * 2]["refusals"], "both ranks of a pair raise the same errors"
        for case, words in REFUSALS.items():
            for word in words:
                assert word in messages[case], f"{case}: {messages[case]!r} lacks {word!r}"
