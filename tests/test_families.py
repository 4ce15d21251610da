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


def test_views_are_the_entries():
    assert list(families.FUSED_ATTENTIONS) == [f.attention for f in FAMILIES.values() if f.unfused is None]
    assert families.UNFUSED_ATTENTIONS == {"Gemma4TextAttention": families.FAMILIES["gemma4_text"].unfused}
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
