"""``upipe.head_chunk_size: "auto"`` measures the attention of the model's layer as the model will run it.

Where a route has the model (``ds_upipe.initialize``, the Trainer / accelerate registration), "auto"
runs the attention module of a decoder layer of each kind the model has on fake tensors, patched by
``hf_patches.apply_upipe`` with the block's fused projections, recompute, overlap, accumulation and
ring, on unpacked and packed rows (``auto_chunk.attention_stage_bytes_by_u`` with ``model_config``,
``fake_run.attention_step``), every valid U in one run.  These tests run in this process (no process
group: no child process); each fake run takes about half a second, and the measurements are cached
per spec, so the tests share them.  The routes passing the model are checked in the existing spawn
of tests/test_upipe_keys.py (all three routes) and the "auto" run of tests/test_engine_launch.py.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from ds_upipe.integration import fake_run
from ds_upipe.integration.auto_chunk import attention_stage_bytes_by_u, choose_head_chunk_size
from ds_upipe.integration.config import UPipeConfig
from ds_upipe.options import UPipeOptions
from ds_upipe.schedule import valid_head_chunk_sizes
from ds_upipe.tools.models import tiny_config

SEQ = 1024
#: a tiny Llama: 8 query heads, 2 KV heads, head_dim 16, over C = 2 ranks: U in (2, 4, 8)
MODEL = tiny_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2)
DIMS = dict(num_heads=8, num_kv_heads=2, head_dim=16, group_size=2, micro_batch_size=1, dtype_bytes=4)
VALID = valid_head_chunk_sizes(8, 2, 2)


def _need(model: Any = MODEL, **settings: Any) -> dict[int, int]:
    dims = {**DIMS, **{k: settings.pop(k) for k in ("dtype_bytes",) if k in settings}}
    return attention_stage_bytes_by_u(VALID, **dims, seq_length=SEQ, model_config=model, **settings)


def _measured(block: UPipeConfig) -> dict[int, int]:
    """The layer measurement of a block's settings, each passed to the measurement explicitly."""
    return _need(
        fused_projections=block.fused_projections,
        recompute_attention_output=block.recompute_attention_output,
        overlap_comm=block.overlap_comm,
    )


def _pick(need: dict[int, int], budget: int) -> int:
    """The largest U whose need fits (C when none does): the rule "auto" applies."""
    fits = [u for u, size in need.items() if size <= budget]
    return max(fits) if fits else DIMS["group_size"]


def _budget_where_they_differ(a: dict[int, int], b: dict[int, int]) -> int:
    """A budget (bytes) at which the two measurements pick different U (AssertionError if none)."""
    for budget in sorted(set(a.values()) | set(b.values())):
        if _pick(a, budget) != _pick(b, budget):
            return budget
    raise AssertionError(f"no budget separates the two measurements: {a} vs {b}")


def _choose(budget: int, model: Any = MODEL, fused: bool | None = None, dtype_bytes: int = 4, **block: Any) -> int:
    cfg = UPipeConfig(head_chunk_size="auto", memory_budget_gib=budget / 2**30, seq_length=SEQ, **block)
    options = None if fused is None else cfg.options(None).as_run(fused)
    return choose_head_chunk_size(cfg, **{**DIMS, "dtype_bytes": dtype_bytes}, model_config=model, options=options)


def test_fused_recompute_overlap_chooses_by_the_layer_not_the_core():
    """fused + recompute + overlap: at a budget where the old core-only measurement (UPipeDistributedAttention
    on q, k, v) picks a U whose real attention (the fused layer, measured directly with
    ``fake_run.attention_step``, unpacked and packed) exceeds the budget, "auto" picks the largest U whose
    real attention fits.  Mutation: ``choose_head_chunk_size`` not passing ``model_config`` on (the core
    measurement again) picks the old U and fails."""
    block = dict(fused_projections=True, recompute_attention_output=True, overlap_comm=True)
    old = attention_stage_bytes_by_u(VALID, **DIMS, seq_length=SEQ, overlap_comm=True)  # core only
    model = fake_run.HFModelConfig.of(MODEL)
    real = {
        u: max(
            fake_run.attention_step(
                fake_run.StepSpec(
                    model,
                    "upipe",
                    2,
                    SEQ,
                    options=UPipeOptions(head_chunk_size=u, recompute_attention_output=True, overlap_comm=True),
                    dtype="fp32",
                ),
                packed,
            ).activations
            for packed in (False, True)
        )
        for u in VALID
    }
    # a budget at which the core-only choice does not fit the real attention, and a smaller U does
    budgets = sorted(set(old.values()) | set(real.values()))
    budget = next(b for b in budgets if real[_pick(old, b)] > b and min(real.values()) <= b)
    old_u, new_u = _pick(old, budget), _choose(budget, **block)
    assert real[old_u] > budget, (old_u, real, budget)
    assert new_u == max(u for u in VALID if real[u] <= budget) != old_u, (new_u, old_u, real, old, budget)
    print(
        f"budget {budget} B: core-only U={old_u} (its real attention {real[old_u]} B), auto U={new_u} ({real[new_u]} B)"
    )


@pytest.mark.parametrize(
    "on, off",
    [
        # fused projections (per-stage q/k/v from the layer input) or the model's own projections
        (dict(fused_projections=True), dict(fused_projections=False)),
        # fused: the attention output recomputed in backward instead of kept
        (dict(recompute_attention_output=True), dict(recompute_attention_output=False)),
        # the next stage's all-to-alls in flight beside the current stage's buffers (fused layer)
        (dict(overlap_comm=True), dict(overlap_comm=False)),
    ],
    ids=["fused_projections", "recompute_attention_output", "overlap_comm"],
)
def test_each_setting_reaches_the_measurement(on, off):
    """The setting changes the layer measurement and, at a budget between, the choice.  Mutations (each
    fails its case): fused: ``run_head_chunk_size`` passing fused projections on always, or
    ``_patched_model`` dropping ``spec.options``; recompute: ``attention_stage_bytes_by_u`` not forwarding
    ``recompute_attention_output`` (or ``UPipeConfig.options`` dropping it);
    overlap: ``overlap_comm`` dropped on the way to ``apply_upipe``."""
    need_on, need_off = (_measured(UPipeConfig(**block)) for block in (on, off))
    budget = _budget_where_they_differ(need_on, need_off)
    assert _choose(budget, **on) == _pick(need_on, budget) != _pick(need_off, budget) == _choose(budget, **off)


def test_accumulate_dtype_reaches_the_measurement():
    """bf16 with ``accumulate_dtype: "input"``: the fused node's dx / weight-gradient sums and the round's
    dK/dV sums in bf16, not float32: less memory, and the choice follows.  Mutation: dropping
    ``accumulate_in_input_dtype`` on the way to ``apply_upipe`` (``_patched_model``) or in
    ``choose_head_chunk_size`` fails."""
    fp32_sums, input_sums = (
        _need(fused_projections=True, dtype_bytes=2, accumulate_in_input_dtype=on) for on in (False, True)
    )
    assert all(input_sums[u] < fp32_sums[u] for u in VALID), (fp32_sums, input_sums)
    budget = _budget_where_they_differ(input_sums, fp32_sums)
    assert _choose(budget, dtype_bytes=2, accumulate_dtype="input") == _pick(input_sums, budget)
    assert _choose(budget, dtype_bytes=2, accumulate_dtype="fp32") == _pick(fp32_sums, budget)


def test_packed_rows_are_measured_and_the_larger_counts():
    """Packing changes the kernel path (``DocumentKernel``: per-document segments beside the row's
    buffers), and memory: the packed row needs more here, and "auto" counts the larger of the two.
    Mutation: ``attention_activations`` measuring unpacked rows only fails."""
    model = fake_run.HFModelConfig.of(MODEL)
    need = _need(fused_projections=True)
    for u in VALID:
        spec = fake_run.StepSpec(model, "upipe", 2, SEQ, options=UPipeOptions(head_chunk_size=u), dtype="fp32")
        plain, packed = (fake_run.attention_step(spec, p).activations for p in (False, True))
        assert need[u] == max(plain, packed), (u, need[u], plain, packed)
    spec = fake_run.StepSpec(model, "upipe", 2, SEQ, options=UPipeOptions(head_chunk_size=2), dtype="fp32")
    assert fake_run.attention_step(spec, True).activations > fake_run.attention_step(spec, False).activations


def test_fused_as_apply_upipe_decides_for_the_model():
    """A model apply_upipe runs unfused although fused projections are asked (PEFT LoRA on q_proj:
    not a plain nn.Linear) is measured unfused.  Mutation: ``auto_chunk.runs_fused`` returning
    ``upipe.fused_projections`` fails."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from ds_upipe.integration.auto_chunk import runs_fused

    auto = UPipeConfig(head_chunk_size="auto", memory_budget_gib=1.0, seq_length=SEQ)
    model = LlamaForCausalLM(tiny_config("llama"))
    assert runs_fused(model, auto)
    lora = get_peft_model(LlamaForCausalLM(tiny_config("llama")), LoraConfig(r=2, target_modules=["q_proj"]))
    assert not runs_fused(lora, auto)
    assert not runs_fused(model, auto.model_copy(update={"fused_projections": False}))


def test_every_u_in_one_fake_run(monkeypatch):
    """One fake run (one child process in a training job) for all valid U, with the model too.
    Mutation: measuring U by U makes ``calls`` one per U."""
    calls = []
    isolated = fake_run.isolated

    def counting(function, **kwargs):
        calls.append((function, kwargs.get("head_chunk_sizes"), kwargs.get("model") is not None))
        return isolated(function, **kwargs)

    monkeypatch.setattr(fake_run, "isolated", counting)
    assert _choose(2**40) == max(VALID)
    assert calls == [("attention_activations", VALID, True)]


def test_model_type_transformers_cannot_build_falls_back_to_the_core():
    """A config transformers cannot build from its model type (remote code) is measured as the core
    layer (with a warning), not an error at setup.  Mutation: ``HFModelConfig.of`` without the
    ``CONFIG_MAPPING`` check raises in the fake run."""
    from transformers import LlamaConfig

    class RemoteConfig(LlamaConfig):
        model_type = "remote_llama_for_test"

    remote = RemoteConfig(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=2)
    assert _need(model=remote) == attention_stage_bytes_by_u(VALID, **DIMS, seq_length=SEQ)


def test_every_kind_of_layer_is_measured():
    """A model of full and sliding-window layers (Qwen2 with ``layer_types``, the full one first) runs
    every layer at the chosen U, so "auto" measures a layer of each kind and keeps the larger need
    (``HFModelConfig.layer_kinds``).  On CPU the windowed kernel's banded tiles need more than full
    causal attention, so the sliding layer sets it here.  Mutation: measuring the first layer only
    (``layer_kinds`` returning [self]) gives the full layer's need and fails."""
    mixed = tiny_config(
        "qwen2",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=64,
        layer_types=["full_attention", "sliding_attention"],
    )
    kinds = fake_run.HFModelConfig.of(mixed).layer_kinds()
    assert [json.loads(k.json_text)["layer_types"][0] for k in kinds] == ["full_attention", "sliding_attention"]
    per_kind = [_need(model=k.config(1)) for k in kinds]  # one layer: of that kind only
    assert per_kind[0] != per_kind[1], per_kind  # the two kinds need different memory (else this tests nothing)
    assert _need(model=mixed) == {u: max(need[u] for need in per_kind) for u in VALID}


def test_gemma4_measures_each_kind_with_its_head_dim():
    """Gemma 4 (tests/family_cases.py's: sliding layers of head dim 8, full of 16, KV-shared layers): "auto" builds
    a layer of each kind with its own head dim (per-layer settings rotated with ``layer_types``; one full layer more
    where its config would turn the last, measured, sliding layer into a full one) and runs its attention as the
    decoder layer calls it (``shared_kv_states``, the rotary embedding of its layer type).  Mutation: the kinds
    built without their per-layer settings give both layers one head dim and fail."""
    from tests.family_cases import build_family

    config = build_family("gemma4").config
    built = [k.config(1) for k in fake_run.HFModelConfig.of(config).layer_kinds()]
    assert [(c.layer_types[0], c.per_layer_config[0].head_dim) for c in built] == [
        ("sliding_attention", 8),
        ("full_attention", 16),
    ]
    need = attention_stage_bytes_by_u([2], **{**DIMS, "head_dim": 16}, seq_length=64, model_config=config)
    assert list(need) == [2] and need[2] > 0, need


# -- mixer_head_chunk_size: "auto" ----------------------------------------------------------------

#: the bench's tiny gated delta net (``bench.mixer_config``): 8 value heads on 4 key heads of 16, hidden 64, over
#: C = 2 ranks: U in (2, 4, 8)
MIXER = dict(heads=8, kv_heads=4, head_dim=16, ssm_state=16, ssm_chunk=16, hidden=64, intermediate=128)
MIXER_US = (2, 4, 8)


def _mixer_config() -> Any:
    from ds_upipe.tools.bench import BenchSpec, mixer_config

    spec = BenchSpec(world=2, seq_lens=[SEQ], levels=("mixer",), dtype="float32", repeats=0, **MIXER)
    return mixer_config(spec, "gated_delta")


def measure_mixer_module(rank: int, world: int) -> dict[int, int]:
    """The patched gated delta net's forward + backward on real tensors on this gloo rank (torch's MemTracker via
    ``tools.memory.measure_peak``), at each U: the step ``mixer_head_chunk_size: "auto"`` predicts on fake ones."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ds_upipe.tools.memory import measure_peak
    from hf_patches import apply_upipe
    from hf_patches.architectures import find_decoder

    peaks = {}
    for u in MIXER_US:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_mixer_config()).float()
        apply_upipe(model, dist.group.WORLD, mixer_head_chunk_size=u)
        mixer = find_decoder(model).mixers[0][1]
        h = torch.randn(1, SEQ // world, MIXER["hidden"], requires_grad=True)
        dout = torch.randn(1, SEQ // world, MIXER["hidden"])
        step = functools.partial(lambda m, x, g: m(x).backward(g), mixer, h, dout)
        peaks[u] = measure_peak(step, [mixer, h, dout], torch.device("cpu"))
    return peaks


def test_mixer_auto_predicts_a_real_run_and_picks_by_attentions_rule():
    """``mixer_head_chunk_size: "auto"``: the fake-tensor measurement of the model's mixer layer (``fake_run.
    mixer_step``, what ``mixer_stage_bytes_by_u`` runs) against the same step on real tensors on C = 2 gloo ranks
    (MemTracker, worst rank): within 5% at every U; then the choice at budgets around each U's measured need is
    the largest U that fits (C where none does), the rule attention's "auto" applies (``largest_fitting``).
    Mutation: ``choose_mixer_head_chunk_size`` taking the smallest fitting U fails the choice."""
    from ds_upipe.integration.auto_chunk import choose_mixer_head_chunk_size, mixer_stage_bytes_by_u
    from ds_upipe.tools.ranks import run_ranks

    config = _mixer_config()
    measured = run_ranks(measure_mixer_module, 2)
    model = fake_run.HFModelConfig.of(config)
    for u in MIXER_US:
        spec = fake_run.StepSpec(model, "upipe", 2, SEQ, options=UPipeOptions(mixer_head_chunk_size=u), dtype="fp32")
        predicted, real = fake_run.mixer_step(spec).total, max(r[u] for r in measured)
        assert abs(predicted / real - 1) <= 0.05, (u, predicted, real)
    need = mixer_stage_bytes_by_u(model_config=config, group_size=2, seq_length=SEQ, micro_batch_size=1, dtype_bytes=4)
    assert sorted(need) == list(MIXER_US) and need[2] < need[4] < need[8], need
    for budget, expected in ((need[2] - 1, 2), (need[4], 4), (need[8] - 1, 4), (need[8], 8)):
        block = UPipeConfig(mixer_head_chunk_size="auto", memory_budget_gib=budget / 2**30, seq_length=SEQ)
        got = choose_mixer_head_chunk_size(block, model_config=config, group_size=2, micro_batch_size=1, dtype_bytes=4)
        assert got == expected, (budget, got, need)
    print(f"mixer stage bytes by U {need}; measured (real) peaks {measured}")
