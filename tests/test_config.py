"""The "upipe" ds_config block and the config checks of ds_upipe.initialize (pure, no processes)."""

import json
import re
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from ds_upipe.integration.auto_chunk import attention_stage_bytes, choose_head_chunk_size
from ds_upipe.integration.config import (
    ALLOWED,
    Tiled,
    UPipeConfig,
    check_heads,
    check_world,
    load_config,
    micro_batch_size,
    parse_config,
    parse_upipe_block,
    tiled,
)
from ds_upipe.integration.engine import SequenceParallelSampler
from ds_upipe.schedule import valid_head_chunk_sizes

REPO = Path(__file__).resolve().parents[1]
DIMS = dict(num_heads=8, num_kv_heads=2, head_dim=16, group_size=2, micro_batch_size=1, dtype_bytes=4)


def test_defaults():
    cfg = parse_upipe_block(None)
    assert cfg == UPipeConfig()
    assert (cfg.enabled, cfg.head_chunk_size, cfg.fused_projections, cfg.kernel) == (True, None, True, "sdpa")
    assert (cfg.memory_budget_gib, cfg.seq_length, cfg.offload_checkpoints, cfg.overlap_comm) == (
        None,
        None,
        False,
        False,
    )
    assert cfg.accumulate_dtype == "fp32"  # docs/config.md: measured, the more accurate one
    assert cfg.recompute_attention_output is False
    assert set(ALLOWED) == set(UPipeConfig.model_fields)
    assert parse_upipe_block({"accumulate_dtype": "input"}).accumulate_dtype == "input"


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ValueError) as err:
        parse_upipe_block({"enabled": True, "head_chunk_sz": 4})
    msg = str(err.value)
    assert "upipe.head_chunk_sz: unknown key" in msg
    assert "allowed keys: enabled, head_chunk_size, mixer_head_chunk_size, fused_projections, kernel" in msg


@pytest.mark.parametrize(
    "key, value",
    [
        ("enabled", "yes"),
        ("enabled", 1),
        ("head_chunk_size", "big"),
        ("head_chunk_size", 2.0),
        ("head_chunk_size", True),
        ("head_chunk_size", 0),
        ("head_chunk_size", -4),
        ("mixer_head_chunk_size", "big"),
        ("mixer_head_chunk_size", 0),
        ("fused_projections", "true"),
        ("kernel", "flash"),
        ("memory_budget_gib", 0),
        ("memory_budget_gib", "8GiB"),
        ("seq_length", 0),
        ("seq_length", 1.5),
        ("offload_checkpoints", None),
        ("overlap_comm", "yes"),
        ("ring_size", 0),
        ("ring_size", 2.0),
        ("ring_size", True),
        ("accumulate_dtype", "bf16"),
        ("accumulate_dtype", None),
        ("recompute_attention_output", "true"),
        ("recompute_attention_output", 1),
    ],
)
def test_bad_value_names_key_value_and_allowed(key, value):
    with pytest.raises(ValueError) as err:
        parse_upipe_block({key: value})
    msg = str(err.value)
    assert f"upipe.{key}: got {value!r}; allowed: {ALLOWED[key]}" in msg, msg


def test_every_kernel_name_is_a_config_value_and_a_kernel():
    """``kernel`` takes exactly the names ``make_kernel`` builds ("fa3" included), and reaches the options."""
    from ds_upipe.kernel_choice import KERNELS
    from ds_upipe.options import KERNEL_NAMES

    assert sorted(KERNEL_NAMES) == sorted(KERNELS)
    for name in KERNEL_NAMES:
        assert parse_upipe_block({"kernel": name}).options(None).kernel == name


def test_several_bad_keys_all_reported():
    with pytest.raises(ValueError) as err:
        parse_upipe_block({"enabled": "no", "kernel": "x", "foo": 1})
    msg = str(err.value)
    assert "upipe.enabled" in msg and "upipe.kernel" in msg and "upipe.foo: unknown key" in msg


def test_auto_needs_budget_and_length():
    with pytest.raises(ValueError, match=r"needs upipe.memory_budget_gib .* and upipe.seq_length"):
        parse_upipe_block({"head_chunk_size": "auto", "memory_budget_gib": 4})
    cfg = parse_upipe_block({"head_chunk_size": "auto", "memory_budget_gib": 4, "seq_length": 1024})
    assert cfg.head_chunk_size == "auto"
    with pytest.raises(ValueError, match=r"upipe.mixer_head_chunk_size=\"auto\" needs upipe.memory_budget_gib"):
        parse_upipe_block({"mixer_head_chunk_size": "auto", "seq_length": 1024})
    cfg = parse_upipe_block({"mixer_head_chunk_size": "auto", "memory_budget_gib": 4, "seq_length": 1024})
    assert cfg.mixer_head_chunk_size == "auto" and cfg.options(2, 4).mixer_head_chunk_size == 4


def test_block_must_be_object():
    with pytest.raises(ValueError, match='"upipe" must be a JSON object, got list'):
        parse_upipe_block([1])


@pytest.mark.parametrize("sp", ["2", 0, True, 1.0])
def test_sequence_parallel_size_type(sp):
    with pytest.raises(ValueError, match=r"sequence_parallel_size: got .*; allowed: an int >= 1"):
        parse_config({"sequence_parallel_size": sp})


def test_zero_stage_0_refused_with_sp_only():
    with pytest.raises(ValueError, match=r"zero_optimization.stage: got 0 .*allowed: 1, 2 or 3"):
        parse_config({"sequence_parallel_size": 2})
    assert parse_config({}).zero_stage == 0  # no SP: anything DeepSpeed accepts


def test_partition_activations_refused_with_sp_only():
    act = {"activation_checkpointing": {"partition_activations": True}}
    with pytest.raises(ValueError, match=r"activation_checkpointing.partition_activations: got true .*allowed: false"):
        parse_config({"sequence_parallel_size": 2, "zero_optimization": {"stage": 3}, **act})
    assert parse_config({"zero_optimization": {"stage": 3}, **act}).sequence_parallel_size == 1


def test_settings_read_from_config():
    s = parse_config(
        {"sequence_parallel_size": 4, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "upipe": {}}
    )
    assert (s.sequence_parallel_size, s.zero_stage, s.dtype_bytes, s.upipe) == (4, 2, 2, UPipeConfig())
    assert parse_config({}).dtype_bytes == 4


def test_world_must_be_divisible():
    assert check_world(2, 4) == 2
    with pytest.raises(
        ValueError, match=re.escape("got 3 for a world of 4 processes; allowed: a divisor of the world size [1, 2, 4]")
    ):
        check_world(3, 4)
    with pytest.raises(ValueError, match=re.escape("[1, 2]")):
        check_world(4, 2)


def test_heads_must_split_over_group():
    check_heads(8, 2, 4)  # KV replicated 2x
    with pytest.raises(ValueError) as err:
        check_heads(8, 2, 3)
    assert "sequence_parallel_size: got 3" in str(err.value)
    assert "Allowed sequence_parallel_size for this model: [1, 2, 4, 8]" in str(err.value)
    with pytest.raises(ValueError, match=re.escape("num_key_value_heads=3")):
        check_heads(6, 3, 2)  # neither 3 | 2 nor 2 | 3


def test_ring_size_divides_sp_and_heads_split_over_ulysses_degree():
    settings = parse_config({"sequence_parallel_size": 8, "upipe": {"ring_size": 2}, "zero_optimization": {"stage": 3}})
    assert (settings.ring_size, settings.ulysses_size) == (2, 4)
    assert parse_config({"sequence_parallel_size": 4, "zero_optimization": {"stage": 1}}).ring_size == 1
    with pytest.raises(
        ValueError, match=re.escape("upipe.ring_size: got 3 for sequence_parallel_size=4; allowed: a divisor")
    ):
        parse_config({"sequence_parallel_size": 4, "upipe": {"ring_size": 3}, "zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match=re.escape("upipe.ring_size: got 2 with upipe.enabled=false")):
        parse_config({"sequence_parallel_size": 4, "upipe": {"ring_size": 2, "enabled": False}})
    # heads are checked against C_u = sp / R, not sp: 6 heads / 3 KV heads fail at C_u = 4, fit at C_u = 2 or 1
    check_heads(6, 3, 4, ring_size=4)
    check_heads(6, 2, 4, ring_size=2)
    with pytest.raises(ValueError) as err:
        check_heads(6, 3, 8, ring_size=2)
    msg = str(err.value)
    assert "upipe.ring_size: got 2 with sequence_parallel_size=8" in msg
    assert "Ulysses degree 4 = 8 / 2" in msg and "num_attention_heads=6, num_key_value_heads=3" in msg
    assert "Allowed Ulysses degrees (sequence_parallel_size / ring_size) for this model: [1, 3, 6]" in msg


def test_ring_stage_memory_is_per_ring_block():
    """With a ring ``"auto"`` runs the real ring on fake tensors (rank 0 of C_u x R): a stage gathers its
    ring block (S / R tokens) plus the K/V block in flight and the travelling dK/dV, so it needs less than
    the whole sequence without a ring and more than half of it."""
    from ds_upipe.integration import fake_run

    dims = {**DIMS, "group_size": 2}
    no_ring = attention_stage_bytes(2, **dims, seq_length=1024)
    half = attention_stage_bytes(2, **dims, seq_length=512)
    ring = attention_stage_bytes(2, **dims, seq_length=1024, ring_size=2)
    heads = dict(num_heads=DIMS["num_heads"], num_kv_heads=DIMS["num_kv_heads"], head_dim=DIMS["head_dim"])
    fake = fake_run.core_step(**heads, sp_size=4, head_chunk_size=2, seq_len=1024, dtype="fp32", ring_size=2)
    assert ring == fake.activations and half < ring < no_ring, (half, ring, no_ring)


def test_recompute_attention_output_needs_fused_upipe():
    """upipe.recompute_attention_output acts only where fused UPipe owns o_proj's weight gradient."""
    base = {"sequence_parallel_size": 2, "zero_optimization": {"stage": 3}}
    assert parse_config(base).upipe.recompute_attention_output is False
    on = parse_config({**base, "upipe": {"recompute_attention_output": True}}).upipe
    assert on.recompute_attention_output and on.fused_projections
    for other, want in (
        ({"enabled": False}, "upipe.recompute_attention_output: got true with upipe.enabled=false; allowed: false"),
        (
            {"fused_projections": False},
            "upipe.recompute_attention_output: got true: recompute_attention_output=True needs fused_projections=True",
        ),
    ):
        with pytest.raises(ValueError) as err:
            parse_config({**base, "upipe": {"recompute_attention_output": True, **other}})
        msg = str(err.value)
        assert msg.startswith("invalid ds_config: ") and want in msg, msg
        off = parse_config({**base, "upipe": {"recompute_attention_output": False, **other}}).upipe
        assert off.model_dump(include=set(other)) == other  # off, the same settings are fine


def test_explicit_head_chunk_size():
    assert choose_head_chunk_size(UPipeConfig(), **DIMS) == 2  # null means U = C
    assert choose_head_chunk_size(UPipeConfig(head_chunk_size=8), **DIMS) == 8
    with pytest.raises(ValueError) as err:
        choose_head_chunk_size(UPipeConfig(head_chunk_size=3), **DIMS)
    msg = str(err.value)
    assert msg.startswith("invalid ds_config: upipe.head_chunk_size:")
    assert f"Valid values: {valid_head_chunk_sizes(8, 2, 2)}" in msg


def test_stage_memory_is_the_fake_tensor_run_of_the_core():
    # "auto" and ds-upipe plan share one model: UPipeDistributedAttention run on fake tensors
    from ds_upipe.integration import fake_run

    peak = fake_run.core_step(8, 2, 16, 2, 2, 1024, batch=DIMS["micro_batch_size"], dtype="fp32")
    assert attention_stage_bytes(2, **DIMS, seq_length=1024) == peak.activations > 0
    sizes = [attention_stage_bytes(u, **DIMS, seq_length=1024) for u in valid_head_chunk_sizes(8, 2, 2)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)  # more heads per stage, more memory


def test_auto_plans_the_configured_accumulation():
    """bf16 with accumulate_dtype "input": the round's float32 dK/dV accumulators (S x kv heads per rank
    x d x 4 bytes each) are gone from the stage memory "auto" compares (each stage's dK/dV is sent at
    once instead), and the choice follows."""
    bf16 = {**DIMS, "dtype_bytes": 2}
    fp32_acc, input_acc = (
        attention_stage_bytes(4, **bf16, seq_length=4096, accumulate_in_input_dtype=on) for on in (False, True)
    )
    assert fp32_acc - input_acc >= 4096 * 1 * 16 * 4, (fp32_acc, input_acc)
    budget = (fp32_acc + input_acc) / 2 / 2**30  # U = 4 fits only with input-dtype sums
    for acc, want in (("fp32", 2), ("input", 4)):
        cfg = UPipeConfig(head_chunk_size="auto", memory_budget_gib=budget, seq_length=4096, accumulate_dtype=acc)
        assert choose_head_chunk_size(cfg, **bf16) == want


def test_auto_plans_the_configured_overlap():
    """overlap_comm keeps the next stage's gathered q (and a second stage's buffers) alive beside the
    current stage's: "auto" measures that, so a budget between the two needs picks a smaller U with
    overlap (issue 22: U = 8 was picked for a budget U = 8 exceeds with overlap)."""
    plain, overlapped = (attention_stage_bytes(4, **DIMS, seq_length=4096, overlap_comm=on) for on in (False, True))
    assert overlapped > plain, (plain, overlapped)
    budget = (plain + overlapped) / 2 / 2**30
    for overlap, want in ((False, 4), (True, 2)):
        cfg = UPipeConfig(head_chunk_size="auto", memory_budget_gib=budget, seq_length=4096, overlap_comm=overlap)
        assert choose_head_chunk_size(cfg, **DIMS) == want


def test_auto_measures_every_u_in_one_run(monkeypatch):
    """One fake run (one child process in a training job) for all valid U, not one per U.  Mutation:
    measuring U by U (``attention_stage_bytes`` per U) makes ``calls`` the number of valid U."""
    from ds_upipe.integration import fake_run

    calls = []
    isolated = fake_run.isolated

    def counting(function, **kwargs):
        calls.append(kwargs.get("head_chunk_sizes"))
        return isolated(function, **kwargs)

    monkeypatch.setattr(fake_run, "isolated", counting)
    cfg = UPipeConfig(head_chunk_size="auto", memory_budget_gib=1.0, seq_length=1024)
    assert choose_head_chunk_size(cfg, **DIMS) == max(valid_head_chunk_sizes(8, 2, 2))
    assert calls == [valid_head_chunk_sizes(8, 2, 2)]


def test_auto_picks_largest_that_fits():
    valid = valid_head_chunk_sizes(8, 2, 2)
    assert len(valid) >= 3
    need = {u: attention_stage_bytes(u, **DIMS, seq_length=4096) for u in valid}
    for i, u in enumerate(valid):
        # a budget just above u's need and below the next size's picks u
        budget = need[u] + (need[valid[i + 1]] - need[u]) // 2 if i + 1 < len(valid) else need[u] * 10
        cfg = UPipeConfig(head_chunk_size="auto", memory_budget_gib=budget / 2**30, seq_length=4096)
        assert choose_head_chunk_size(cfg, **DIMS) == u
    tiny = UPipeConfig(head_chunk_size="auto", memory_budget_gib=1e-9, seq_length=4096)
    assert choose_head_chunk_size(tiny, **DIMS) == 2  # nothing fits: C


def test_micro_batch_size():
    assert micro_batch_size({"train_micro_batch_size_per_gpu": 3}, 2) == 3
    assert micro_batch_size({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 4) == 2
    assert micro_batch_size({}, 4) == 1


def test_load_config_copies_and_reads_paths(tmp_path):
    original = {"upipe": {"enabled": True}}
    loaded = load_config(original)
    loaded["upipe"]["enabled"] = False
    assert original["upipe"]["enabled"] is True
    path = tmp_path / "c.json"
    path.write_text(json.dumps(original))
    assert load_config(str(path)) == original == load_config(path)
    with pytest.raises(ValueError, match="path or a dict"):
        load_config(3)


SHIPPED = ["upipe_zero3", "upipe_zero3_offload", "upipe_zero2", "ulysses_alst_zero3"]
LONG_CONTEXT = ["upipe_long_context", "ulysses_alst_long_context"]


@pytest.mark.parametrize("name", SHIPPED + LONG_CONTEXT)
def test_shipped_configs_parse(name):
    settings = parse_config(load_config(REPO / "ds_configs" / f"{name}.json"))
    assert settings.sequence_parallel_size == 4
    assert settings.upipe.enabled is not name.startswith("ulysses_alst")
    assert settings.upipe.long_context is (name in LONG_CONTEXT)


def test_long_context_configs_differ_only_in_enabled():
    """UPipe and ALST compare on the same stack: ZeRO-3, every tiled part, offloaded checkpoints."""
    upipe, alst = (load_config(REPO / "ds_configs" / f"{name}.json") for name in LONG_CONTEXT)
    u, a = parse_config(upipe).upipe, parse_config(alst).upipe
    # accumulate_dtype and recompute_attention_output are UPipe's own (its stage accumulators, its fused
    # o_proj; ALST has neither): "input" and true, docs/config.md
    own = {"enabled": False, "accumulate_dtype": "fp32", "recompute_attention_output": False}
    assert u.accumulate_dtype == "input" and u.recompute_attention_output and u.model_copy(update=own) == a
    assert (u.tiled_loss, u.tiled_norm, u.tiled_mlp, u.offload_checkpoints) == (True, True, True, True)
    assert upipe["zero_optimization"]["stage"] == 3 and upipe["activation_checkpointing"]["cpu_checkpointing"]
    assert {k: v for k, v in upipe.items() if k != "upipe"} == {k: v for k, v in alst.items() if k != "upipe"}


@pytest.mark.parametrize("key", ["tiled_loss", "tiled_norm", "tiled_mlp"])
def test_long_context_keys(key):
    assert tiled(parse_upipe_block({key: True}).model_dump()[key]) == (True, None)
    assert getattr(parse_upipe_block({key: {"tile_tokens": 64}}), key) == Tiled(tile_tokens=64)
    assert tiled(Tiled(tile_tokens=64)) == (True, 64) and tiled(Tiled()) == (True, None)
    assert parse_upipe_block({key: {}}).long_context and not parse_upipe_block({key: False}).long_context
    for bad in ("true", 1, None, {"tile_tokens": 0}, {"tile_tokens": 2.0}, {"tile_tokens": True}, {"tiles": 8}):
        with pytest.raises(ValueError) as err:
            parse_upipe_block({key: bad})
        assert f"upipe.{key}: got {bad!r}; allowed: {ALLOWED[key]}" in str(err.value), str(err.value)


def test_docs_cover_every_key():
    doc = (REPO / "docs" / "config.md").read_text()
    for key, field in UPipeConfig.model_fields.items():
        assert f"`{key}`" in doc, key
        assert f"`{json.dumps(field.default)}`" in doc, (key, field.default)


@pytest.mark.parametrize("dp, sp, mb", [(1, 2, 1), (2, 2, 1), (1, 4, 2), (2, 2, 3)])
def test_sampler_reproduces_data_parallel_order(dp, sp, mb):
    """The SP micro-batches of replica d, in adapter order (round k: ranks 0..sp-1), are the batches
    DistributedSampler(num_replicas=dp, rank=d) gives a non-SP run, in the same order."""
    dataset = list(range(50))
    for d in range(dp):
        per_rank = [
            list(
                SequenceParallelSampler(
                    dataset,
                    data_parallel_size=dp,
                    data_parallel_rank=d,
                    sequence_parallel_size=sp,
                    sequence_parallel_rank=s,
                    batch_size=mb,
                )
            )
            for s in range(sp)
        ]
        assert len({len(x) for x in per_rank}) == 1  # every rank of the group runs out together
        rounds = len(per_rank[0]) // mb
        adapter_order = [i for k in range(rounds) for s in range(sp) for i in per_rank[s][k * mb : (k + 1) * mb]]
        reference = list(DistributedSampler(dataset, num_replicas=dp, rank=d))
        assert adapter_order == reference[: len(adapter_order)]
        assert len(reference) - len(adapter_order) < sp * mb  # only an incomplete last round is dropped
