"""The long-context stack (hf_patches.apply_long_context_stack, tiled_sequence_parallel_loss):
tiled loss, RMSNorm and MLP equal the untiled path (float64 <= 1e-10, float32 <= 1e-5) on 2 ranks,
alone and in UPipe / plain models end to end, under ZeRO-2 and ZeRO-3 (tied embeddings, ranks of
different lengths); the tiled loss phase and norm hold far less memory; bad settings are refused."""

import torch

from ds_upipe.tools.ranks import run_ranks
from tests import long_context_cases
from tests.hf_cases import TOLERANCE

REFUSALS = {  # case -> words its message must contain (the offending value and the rule)
    "base_model_loss": ["tiled_loss=True", "LlamaModel", "lm_head", "*ForCausalLM"],
    "unsupported_arch": ["GPT2LMHeadModel", "apply_long_context_stack", "not laid out", "layers[i].mlp"],
    "tile_zero": ["mlp_tile_tokens", "got 0", "positive int"],
    "tile_float": ["norm_tile_tokens", "got 2.5"],
    "forward_loss_without_tiled": ["forward_loss='sequence_parallel'", "tiled_loss=True"],
    "forward_loss_name": ["'global'", "'local' or 'sequence_parallel'"],
    "grad_reduction": ["'avg'", "'mean' or 'sum'"],
    "twice": ["already has the long-context stack"],
    "foreign_forward": ["LlamaMLP.forward", "not a method of the module"],
    "loss_on_base": ["LlamaModel has no lm_head", "causal LM"],
    "loss_shapes": ["(1, 3, 64)", "(1, 4)"],
}


def _tolerance(case: str) -> float:
    return TOLERANCE[torch.float32] if "float32" in case or "zero" in case else TOLERANCE[torch.float64]


def _check_exact(results: dict, what: str) -> None:
    assert results, what
    for case, errors in results.items():
        assert max(errors.values()) <= _tolerance(case), f"{what} {case}: {errors}"


def test_components_and_models():
    results = run_ranks(long_context_cases.components, 2)
    for rank, r in enumerate(results):
        _check_exact(r["loss"], f"rank {rank} loss")
        assert len(r["loss"]) == 10
        _check_exact(r["modules"], f"rank {rank} module")
        assert len(r["modules"]) == 24
        _check_exact(r["models"], f"rank {rank} model")
        assert len(r["models"]) == 8
        assert not any(r["chunks"].values()), r["chunks"]

        mem = r["memory"]
        # loss phase: full logits (plus float32 log-softmax and gradients) vs one 64-token tile
        assert mem["loss_full"] >= mem["logits_fp32"] * 2, mem
        assert mem["loss_tiled"] * 8 <= mem["loss_full"], mem
        assert mem["loss_tiled"] <= mem["logits_fp32"] / 4, mem
        # the tiled loss's input hidden state is released before the layers' backward (the old
        # SequenceTiledCompute kept it on its ctx: 131,080 bytes here, the whole hidden state)
        assert mem["act_in_layers_backward"] < mem["hidden_fp32_loss"] / 4, mem
        # norm in bfloat16: beyond the bfloat16 input, output and input gradient, the tiled norm
        # holds less than a quarter of one float32 copy of the hidden state; transformers' holds more
        inherent = 3 * mem["hidden_bf16"]
        assert mem["norm_tiled"] - inherent <= mem["hidden_fp32"] / 4, mem
        assert mem["norm_full"] - inherent >= mem["hidden_fp32"], mem

        # MLP forward: the stack's tiled MLP holds one output (hidden-state) buffer less than
        # DeepSpeed's TiledMLP, whose list of tile outputs and their concatenation are alive together
        assert mem["mlp_tiled"] + mem["mlp_output"] * 3 // 4 <= mem["mlp_deepspeed"], mem

        refusals = r["refusals"]
        assert refusals["foreign_forward_untouched"] == "False", "a refused stack changed the model"
        for case, words in REFUSALS.items():
            for word in words:
                assert word in refusals[case], f"rank {rank} {case}: {refusals[case]!r} lacks {word!r}"
    assert results[0]["refusals"] == results[1]["refusals"], "the same error on every rank"
    assert results[0]["memory"]["norm_full"] == results[1]["memory"]["norm_full"]


def test_zero2_zero3():
    results = run_ranks(long_context_cases.zero_cases, 2, use_deepspeed=True)
    for rank, r in enumerate(results):
        assert len(r) == 5
        for case, errors in r.items():
            assert errors.get("reduced_once", 0) == 0 and errors.get("grad_names", 0) == 0, f"{rank} {case}: {errors}"
            assert max(errors.values()) <= TOLERANCE[torch.float32], f"rank {rank} {case}: {errors}"


def test_default_tiles_cut_every_shard():
    """Tile sizes left unset follow one rule (tiling.default_tile_tokens): at least MIN_TILES tiles of
    the shard, at most the part's byte bound.  Old byte-only defaults made a 2,048-token shard one tile
    at vocab 32K (8,388 tokens per loss tile), so the stack did nothing at the main job's sizes."""
    import hf_patches
    from hf_patches import tiling
    from tests.hf_cases import build_model

    assert tiling.default_tile_tokens(2048, tiling.loss_tile_bound(32000)) == 256
    assert tiling.default_tile_tokens(2**20, tiling.loss_tile_bound(128256)) == (1 << 30) // (4 * 128256)
    assert tiling.default_tile_tokens(2**20, tiling.norm_tile_bound(4096)) == 2**14
    assert tiling.default_tile_tokens(2**20, tiling.mlp_tile_bound(4096)) == 4096
    assert tiling.default_tile_tokens(3, 100) == 1
    model = build_model("llama", torch.float32)
    hf_patches.apply_long_context_stack(model, tiled_loss=True, tiled_norm=True, tiled_mlp=True)
    calls = {"lm_head": 0, "mlp": 0, "norm": 0}
    model.lm_head.register_forward_hook(lambda *a: calls.__setitem__("lm_head", calls["lm_head"] + 1))
    mlp = model.model.layers[0].mlp
    original = mlp._long_context_forward

    def counting(module, x):
        calls["mlp"] += 1
        return original(module, x)

    mlp._long_context_forward = counting
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    model(input_ids=ids, labels=ids).loss.backward()
    # 64 tokens: 8 tiles of 8 in the forward and 8 recomputed in the backward
    assert calls["lm_head"] == 16 and calls["mlp"] == 16, calls


#: the modules the stack tiles in the hybrids' two layouts (tiny configs of ds_upipe.tools.models)
HYBRID_PATCHED = {
    "qwen3_5": [f"layers.{i}.{n}" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")]
    + ["norm", "layers.0.mlp", "layers.1.mlp", "forward"],
    # one-mixer blocks: every block's norm, the final norm_f, the mixer of the MLP-only layer 2 only
    "nemotron_h": ["layers.0.norm", "layers.1.norm", "layers.2.norm", "norm_f", "layers.2.mixer", "forward"],
}


def test_hybrid_layouts_tiled_exactly():
    """Qwen3.5 (layer norms and mlp around a gated delta layer) and Nemotron-H (Mamba-2, attention and MLP-only
    blocks: a norm before each mixer, norm_f) through the whole stack in one process, float64 with transformers'
    float32 casts kept float64 (tests/mixer_mamba2_cases.py ``float64_internals``): loss and every gradient equal
    the untiled model's (tiles of 5 / 3 / 4 tokens over 2 x 12), and the layouts' modules are the ones tiled."""
    import copy

    import hf_patches
    from ds_upipe.tools.models import tiny_causal_lm
    from tests.hf_cases import make_batch, relative_error
    from tests.mixer_mamba2_cases import float64_internals

    for arch, patched in HYBRID_PATCHED.items():
        torch.manual_seed(0)
        plain = tiny_causal_lm(arch, vocab_size=101).to(torch.float64)
        tiled = copy.deepcopy(plain)
        hf_patches.apply_long_context_stack(
            tiled, tiled_loss=True, tiled_norm=True, tiled_mlp=True, loss_tile_tokens=5, norm_tile_tokens=3,
            mlp_tile_tokens=4,
        )  # fmt: skip
        assert hf_patches.long_context_stack(tiled).patched == patched, arch
        batch = make_batch(0, 2, 12)
        with float64_internals():
            losses = [model(**batch).loss for model in (plain, tiled)]
            for loss in losses:
                loss.backward()
        assert relative_error(losses[1], losses[0]) <= TOLERANCE[torch.float64], (arch, losses)
        grads = dict(tiled.named_parameters())
        for name, p in plain.named_parameters():
            error = relative_error(grads[name].grad, p.grad)
            assert error <= TOLERANCE[torch.float64], (arch, name, error)
