"""Exhaustive checks of the stage plan over every accepted (H, Hkv, C, U) up to H = 64."""

import itertools

import pytest

from ds_upipe.schedule import build_plan, check_head_counts, valid_head_chunk_sizes


def all_configs():
    for h, c in itertools.product(range(1, 65), (1, 2, 4, 8)):
        for hkv in (d for d in range(1, h + 1) if h % d == 0):
            try:
                check_head_counts(h, hkv, c)
            except ValueError:
                continue
            for u in valid_head_chunk_sizes(h, hkv, c):
                yield h, hkv, c, u


CONFIGS = list(all_configs())


def test_enumeration_is_large():
    assert len(CONFIGS) > 1000


def test_plan_invariants():
    for h, hkv, c, u_total in CONFIGS:
        plan = build_plan(h, hkv, c, u_total)
        g, u, rep = h // hkv, u_total // c, max(1, c // hkv)
        where = f"H={h} Hkv={hkv} C={c} U={u_total}"
        assert plan.num_stages == h // u_total, where
        seen_queries, kv_sends = [], []
        for rnd in plan.rounds:
            kvr = len(rnd.kv_heads[0])
            assert all(len(kv) == kvr for kv in rnd.kv_heads), where  # even all-to-all
            kv_sends.extend(k for kv in rnd.kv_heads for k in kv)
            for stage in rnd.stages:
                assert all(len(q) == u for q in stage.query_heads), where  # even all-to-all
                for p, queries in enumerate(stage.query_heads):
                    per_kv = u // kvr
                    for i, head in enumerate(queries):
                        # head i of rank p uses the rank's KV head i // (u / kvr): the GQA convention
                        assert head // g == rnd.kv_heads[p][i // per_kv], where
                    seen_queries.extend(queries)
        assert sorted(seen_queries) == list(range(h)), where  # every query head exactly once
        # every KV head is sent exactly once per replica: never re-sent within or across rounds
        assert sorted(kv_sends) == sorted(k for k in range(hkv) for _ in range(rep)), where


@pytest.mark.parametrize("h,hkv,c", [(32, 8, 4), (16, 16, 2), (16, 2, 4), (8, 1, 8), (64, 8, 8)])
def test_full_chunk_is_ulysses_split(h, hkv, c):
    plan = build_plan(h, hkv, c, h)
    assert len(plan.rounds) == 1 and len(plan.rounds[0].stages) == 1
    for p, queries in enumerate(plan.rounds[0].stages[0].query_heads):
        assert queries == tuple(range(p * h // c, (p + 1) * h // c))


def test_paper_example_order():
    """H=16, KV=4, C=4, U=4: stage 0 sends query heads 0, 4, 8, 12 with KV heads 0-3; stage 1 reuses them."""
    plan = build_plan(16, 4, 4, 4)
    assert len(plan.rounds) == 1
    assert plan.rounds[0].kv_heads == ((0,), (1,), (2,), (3,))
    assert [s.query_heads for s in plan.rounds[0].stages][:2] == [((0,), (4,), (8,), (12,)), ((1,), (5,), (9,), (13,))]


def test_default_is_group_size():
    assert build_plan(32, 8, 4).head_chunk_size == 4


@pytest.mark.parametrize(
    "h,hkv,c,u,fragment",
    [
        (16, 4, 4, 6, "positive multiple"),
        (16, 4, 4, 12, "must divide num_heads=16"),
        (48, 8, 4, 16, "whole fraction of a KV group"),
        (16, 4, 4, 0, "positive multiple"),
        (12, 4, 8, None, "not divisible by the sequence-parallel size 8"),
        (24, 6, 4, None, "one must divide the other"),
        (16, 3, 4, None, "not a multiple of num_kv_heads=3"),
    ],
)
def test_invalid(h, hkv, c, u, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_plan(h, hkv, c, u)


def test_head_layout_from_config_falls_back_like_transformers():
    from ds_upipe.heads import HeadLayout

    # no head_dim, no num_key_value_heads: hidden // heads and plain multi-head attention
    plain = HeadLayout.from_config({"hidden_size": 64, "num_attention_heads": 8})
    assert plain == HeadLayout(num_heads=8, num_kv_heads=8, head_dim=8)
    gqa = HeadLayout.from_config(
        {"text_config": {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32}}
    )
    assert gqa == HeadLayout(8, 2, 32)
    assert gqa.valid_group_sizes() == [1, 2, 4, 8]
    assert gqa.valid_head_chunk_sizes(4) == valid_head_chunk_sizes(8, 2, 4)
    with pytest.raises(ValueError, match="num_attention_heads"):
        HeadLayout.from_config({"hidden_size": 64})
