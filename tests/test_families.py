"""The family registry (hf_patches/families.py) names what transformers has: each entry's classes exist in
its model type's modeling module, its causal LM's config is of that model type, its q/k norm is the class
its attention builds, and every view the rest of the code reads is derived from the entries."""

from __future__ import annotations

import importlib
import inspect

import pytest
import transformers

from hf_patches import families
from hf_patches.families import FAMILIES


def _modeling(causal_lm: str):  # noqa: ANN202 - a module
    return importlib.import_module(getattr(transformers, causal_lm).__module__)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_entry_names_transformers_classes(model_type):
    family = FAMILIES[model_type]
    causal_lm = getattr(transformers, family.causal_lm)
    assert causal_lm.config_class.model_type == model_type
    modeling = _modeling(family.causal_lm)
    attention = getattr(modeling, family.attention)
    # the registry call apply_upipe finds (through decorators, as architectures.calls_attention_registry reads it)
    assert "ALL_ATTENTION_FUNCTIONS" in inspect.unwrap(attention.forward).__code__.co_names
    source = inspect.getsource(attention)  # the class as written (its __init__ is wrapped by transformers' kernels)
    if family.unfused is not None:  # runs unfused: no q/k norm for fused mode to reproduce
        assert family.qk_norm is None and family.attention not in families.FUSED_ATTENTIONS, family
    elif family.qk_norm is None:
        assert "self.q_norm" not in source, family
    else:
        norm, kind = family.qk_norm
        assert f"self.q_norm = {norm}(" in source and f"self.k_norm = {norm}(" in source, family
        assert kind in ("rms", "gemma"), family
    if family.planner_layer is not None:
        assert family.planner_layer in FAMILIES, family


#: the multi-head latent attention entries' attention classes
LATENT = ("DeepseekV3Attention", "DeepseekV2Attention", "MiniCPM3Attention", "Glm4MoeLiteAttention")


@pytest.mark.parametrize("attention", LATENT)
def test_latent_entries_are_latent_attention(attention):
    """A latent entry's attention builds MLA's low-rank projections (``kv_b_proj``, ``v_head_dim``): the reason
    its entry gives for running unfused."""
    family = next(f for f in FAMILIES.values() if f.attention == attention)
    source = inspect.getsource(getattr(_modeling(family.causal_lm), family.attention))
    assert "self.kv_b_proj" in source and "self.v_head_dim" in source, family


def test_views_are_the_entries():
    assert list(families.FUSED_ATTENTIONS) == [f.attention for f in FAMILIES.values() if f.unfused is None]
    assert families.UNFUSED_ATTENTIONS == {
        "Gemma4TextAttention": families.FAMILIES["gemma4_text"].unfused,
        **{a: families.latent_unfused(a) for a in LATENT},
    }
    assert families.NORM_KINDS == {"Qwen3RMSNorm": "rms", "Qwen3MoeRMSNorm": "rms", "Gemma3RMSNorm": "gemma"}
    assert set(families.MOE_TYPES) == {"qwen3_moe", "mixtral", "gpt_oss"}
    assert families.PLANNER_LAYERS["gpt_oss"] == "llama" and "granite" not in families.PLANNER_LAYERS


def test_every_entry_is_a_family_of_the_sweep():
    """Each registered family is built and run against the unpatched model by the family sweep
    (tests/family_cases.py, tests/test_hf_parity.py), under its model type: fused unless its entry says why not."""
    from tests.family_cases import FAMILIES as SWEEP

    fused_types = {model_type for model_type, _, fusable in SWEEP.values() if fusable}
    assert fused_types == {t for t, f in FAMILIES.items() if f.unfused is None}
    unfused_types = {model_type for model_type, _, fusable in SWEEP.values() if not fusable}
    assert {t for t, f in FAMILIES.items() if f.unfused is not None} <= unfused_types


def test_gemma4_head_layouts_are_read_per_layer():
    """Gemma 4's head dim is a per-layer attribute (full-attention layers: global_head_dim; its global read raises
    AmbiguousGlobalPerLayerAttributeError): ds_upipe reads every layer's through transformers' per-layer configs,
    the head dims the attention modules have, and the model's one layout has the largest (what bounds a stage)."""
    from ds_upipe.heads import HeadLayout, layer_head_layouts
    from ds_upipe.integration.sp_setup import model_head_layout
    from tests.family_cases import build_family

    model = build_family("gemma4")
    layouts = layer_head_layouts(model.config)
    assert [h.head_dim for h in layouts] == [a.self_attn.head_dim for a in model.model.layers] == [8, 16, 8, 16]
    assert {(h.num_heads, h.num_kv_heads) for h in layouts} == {(8, 2)}
    assert model_head_layout(model) == HeadLayout.from_config(model.config) == HeadLayout(8, 2, 16)
    composite = transformers.Gemma4Config(text_config=model.config.to_dict())
    assert HeadLayout.from_config(composite) == HeadLayout(8, 2, 16)


def test_gemma4_layer_kv_heads_checked_per_layer():
    """Gemma 4 whose full-attention layers have their own key/value heads (num_global_key_value_heads): every
    layer's head counts are read, and each route's checks (the sequence-parallel size, a configured U, "auto"'s
    candidates, the runtime's plans) take every one of them, naming the first layer whose heads do not fit."""
    from ds_upipe.heads import HeadLayout, head_counts
    from ds_upipe.integration.auto_chunk import attention_stage_bytes, choose_head_chunk_size
    from ds_upipe.integration.config import UPipeConfig, check_layer_heads
    from ds_upipe.options import UPipeOptions
    from ds_upipe.runtime import UPipeRuntime
    from tests.family_cases import build_family, layer_kv_heads_model

    model = build_family("gemma4_kv")
    assert head_counts(model.config) == {(8, 2): 0, (8, 1): 1}
    layers = model.model.layers[:2]  # 2 and 3 reuse their keys and values (KV-shared: no k_proj)
    assert [a.self_attn.k_proj.out_features // a.self_attn.head_dim for a in layers] == [2, 1]
    assert HeadLayout.from_config(model.config) == HeadLayout(8, 2, 16)  # the first layer's, the largest head dim
    runtime = UPipeRuntime.build(UPipeOptions(), group=None, layer_heads=head_counts(model.config))
    assert [(p.num_heads, p.num_kv_heads) for p in runtime.plans.values()] == [(8, 2), (8, 1)]
    assert runtime.plan_for(8, 1) is runtime.plans[(8, 1)]

    config = layer_kv_heads_model().config  # 12 query heads; 6 key/value heads on sliding layers, 4 on full ones
    layer1 = "decoder layer 1 (12 query and 4 key/value heads"
    with pytest.raises(ValueError, match=r"decoder layer 1 \(12 query and 4 key/value heads.*size 3"):
        check_layer_heads(config, 3)  # 3 splits the sliding layers' 6 KV heads, not the full layers' 4
    dims = dict(num_heads=12, num_kv_heads=6, head_dim=8, group_size=2, micro_batch_size=1, dtype_bytes=8)
    with pytest.raises(ValueError, match=r"upipe.head_chunk_size: decoder layer 1 .*GQA group size 3"):
        choose_head_chunk_size(UPipeConfig(head_chunk_size=4), **dims, layer_heads=head_counts(config))
    assert choose_head_chunk_size(UPipeConfig(head_chunk_size=4), **dims) == 4  # the sliding layers alone: fits
    # "auto" picks among the U valid for every layer (2, 12 of the sliding layers' 2, 4, 12 and the full's 2, 6, 12)
    need4, need12 = (attention_stage_bytes(u, **dims, seq_length=1024) for u in (4, 12))
    budget = (need4 + need12) / 2 / 2**30  # fits U = 4, not 12
    auto = UPipeConfig(head_chunk_size="auto", memory_budget_gib=budget, seq_length=1024)
    assert choose_head_chunk_size(auto, **dims) == 4
    assert choose_head_chunk_size(auto, **dims, layer_heads=head_counts(config)) == 2
    with pytest.raises(ValueError, match=layer1.replace("(", r"\(")):
        UPipeRuntime.build(UPipeOptions(head_chunk_size=4), group=None, layer_heads=head_counts(config))
