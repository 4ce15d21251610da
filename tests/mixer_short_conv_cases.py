"""Rank bodies of tests/test_mixer_short_conv.py: LFM2 and LFM2-MoE (short gated convs and softmax attention)
through ``apply_upipe`` on sequence shards == the unpatched model on the whole sequence (or each packed
document alone) in one process, float64: logits, loss and every parameter gradient summed over ranks."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import hf_patches
from tests.hf_cases import compare, per_document_reference, reference_step, sharded_step

VOCAB = 101
SEQ = 16
#: conv layers around an attention layer, so a conv's halo feeds the attention and the next conv
LAYER_TYPES = ["conv", "full_attention", "conv"]
#: per world size, two rows of packed documents (cumulative lengths of the global sequence): a start inside
#: a shard, one exactly at a shard boundary, one a token before a boundary (the halo spans two documents),
#: one-token documents; the rows differ, so their windows hold different numbers of starts
PACKED = {
    2: [[0, 5, 8, 15, 16], [0, 7, 12, 16]],  # shards of 8: boundary at 8
    4: [[0, 3, 8, 9, 16], [0, 11, 12, 16]],  # shards of 4: boundaries at 4, 8, 12
}


def build_model(moe: bool, seed: int = 0, **overrides):
    """A tiny float64 LFM2 (conv and in/out projections with bias) or LFM2-MoE (one dense layer, then
    experts; no bias)."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        initializer_range=0.1,
        use_cache=False,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    common.update(overrides)
    if moe:
        config = transformers.Lfm2MoeConfig(
            **common,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_dense_layers=1,
            experts_implementation="eager",  # grouped_mm takes no float64
        )
        cls = transformers.Lfm2MoeForCausalLM
    else:
        config = transformers.Lfm2Config(**common, conv_bias=True, block_auto_adjust_ff_dim=False)
        cls = transformers.Lfm2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float64)
    with torch.no_grad():  # zero-initialised biases would leave their gradients' paths untested
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def random_batch(seed: int, batch: int = 2) -> dict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    labels = ids.clone()
    labels[:, :3] = -100
    return {"input_ids": ids, "labels": labels}


def packed_batch(cus: list[list[int]], seed: int) -> dict:
    """Rows of packed documents as transformers' DataCollatorWithFlattening builds them."""
    from transformers import DataCollatorWithFlattening

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for cu in cus:
        docs = [torch.randint(0, VOCAB, (e - s,), generator=gen).tolist() for s, e in zip(cu, cu[1:])]
        rows.append(DataCollatorWithFlattening()([{"input_ids": d, "labels": d} for d in docs]))
    return {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels", "position_ids")}


def patched_pair(moe: bool, checkpointing: str | None):
    """(patched model, unpatched copy); HF gradient checkpointing ("reentrant", "non_reentrant" or None) on
    the patched one."""
    model = build_model(moe)
    ref = copy.deepcopy(model)
    hf_patches.apply_upipe(model, None)
    if checkpointing:
        model.train()
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"}
        )
    return model, ref


def parity_case(moe: bool, checkpointing: str | None, world: int) -> dict[str, float]:
    model, ref = patched_pair(moe, checkpointing)
    data = random_batch(seed=1)
    return compare(reference_step(ref, data), sharded_step(model, data, dist.group.WORLD), SEQ)


def packed_case(moe: bool, checkpointing: str | None, world: int) -> dict[str, float]:
    model, ref = patched_pair(moe, checkpointing)
    cus = PACKED[world]
    data = packed_batch(cus, seed=2)
    return compare(per_document_reference(ref, data, cus), sharded_step(model, data, dist.group.WORLD), SEQ)


def refusals(world: int) -> dict[str, str]:
    """The messages of what is refused: shards shorter than the halo (at forward), a head chunk size and
    a width causal-conv1d does not take (at apply_upipe)."""
    messages = {}

    def expect(name, fn):
        try:
            fn()
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)

    model = build_model(moe=False)
    hf_patches.apply_upipe(model, None)
    ids = torch.zeros(1, world, dtype=torch.long)  # one token a rank, the halo is 2
    shard = hf_patches.shard_batch({"input_ids": ids}, None)
    expect("short_shard", lambda: model(input_ids=shard["input_ids"], position_ids=shard["position_ids"]))
    expect("head_chunk", lambda: hf_patches.apply_upipe(build_model(moe=True), None, mixer_head_chunk_size=world))
    expect("width", lambda: hf_patches.apply_upipe(build_model(moe=False, conv_L_cache=5), None))
    dist.barrier()
    return messages


CASES = {
    "lfm2": (parity_case, False, None),
    "lfm2_packed": (packed_case, False, None),
    "lfm2_packed_checkpointing_reentrant": (packed_case, False, "reentrant"),
    "lfm2_moe_checkpointing": (parity_case, True, "non_reentrant"),
    "lfm2_moe_packed_checkpointing": (packed_case, True, "non_reentrant"),
}


def short_conv_ranks(rank: int, world: int) -> dict:
    """Every parity case's errors and the refusals' messages of this rank."""
    torch.set_num_threads(1)
    errors = {name: fn(moe, ckpt, world) for name, (fn, moe, ckpt) in CASES.items()}
    return {"errors": errors, "refusals": refusals(world)}
