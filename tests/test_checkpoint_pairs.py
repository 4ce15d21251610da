"""upipe.checkpoint_pairs (ds_upipe.integration.checkpoint_pairs): exact, one hidden state fewer per
pair, per-forward data with the forward, and clear refusals.  In one process: the pairs act on the
layers, whatever the attention; their launch through a real engine is in test_engine_launch."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

pytest.importorskip("deepspeed")
import transformers  # noqa: E402
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing  # noqa: E402

from ds_upipe.integration import checkpoint_pairs  # noqa: E402
from ds_upipe.integration.checkpoint_pairs import install_checkpoint_pairs  # noqa: E402
from ds_upipe.integration.checkpointing import releasing  # noqa: E402
from ds_upipe.integration.config import parse_config  # noqa: E402
from ds_upipe.integration.sp_setup import check_model_settings  # noqa: E402
from ds_upipe.tools.memory import NoModuleTracking  # noqa: E402
from ds_upipe.tools.models import tiny_config  # noqa: E402

HIDDEN = 64


def build(layers: int, dropout: float = 0.0, seed: int = 0, attention: str = "eager") -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = tiny_config(
        "llama", num_hidden_layers=layers, attention_dropout=dropout, vocab_size=101, use_cache=False,
        hidden_size=HIDDEN, intermediate_size=64, attn_implementation=attention,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double().train()


def checkpointed(model, pairs: int, offload: bool):
    """As ``configure_activation_checkpointing`` installs it: DeepSpeed's checkpoint (replayed output
    released) on every layer, the lowest 2 * pairs in pairs."""
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=releasing(ds_checkpointing.checkpoint))
    model.enable_input_require_grads()
    install_checkpoint_pairs(model, pairs, offload)
    return model


def ids(seed: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 101, (2, seq), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, batch, rng_seed: int = 5):
    torch.manual_seed(rng_seed)  # the dropout masks: the same in the reference and the checkpointed run
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def max_error(got: dict, want: dict) -> float:
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


# (layers, pairs, offload, attention dropout): pairs with DeepSpeed layers above them, every layer
# paired, the host-copy store, and dropout (each replay must reproduce its forward's masks)
CASES = [(5, 2, True, 0.0), (4, 2, False, 0.0), (3, 1, True, 0.3)]


@pytest.mark.parametrize("layers,pairs,offload,dropout", CASES)
def test_float64_parity(layers, pairs, offload, dropout):
    reference = build(layers, dropout)
    model = checkpointed(copy.deepcopy(reference), pairs, offload)
    batch = ids(1, 12)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    loss, grads = loss_and_grads(model, batch)
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    assert max_error(grads, ref_grads) <= 1e-12
    stores = [pair.store for pair in model.upipe_checkpoint_pairs]
    assert len(stores) == pairs
    # the host copies are exact-size buffers, back in each pair's pool after the backward
    assert all(s.allocated_bytes == (2 * 12 * HIDDEN * 8 if offload else 0) for s in stores)
    assert all(len(s._free) == (1 if offload else 0) for s in stores)


def test_replay_without_the_forward_rng_is_caught(monkeypatch):
    """The parity test can fail: replays that do not restore the forward's RNG state draw other
    dropout masks, and the gradients differ."""
    monkeypatch.setattr(checkpoint_pairs, "replaying", lambda state: contextlib.nullcontext())
    reference = build(3, 0.3)
    model = checkpointed(copy.deepcopy(reference), 1, True)
    batch = ids(1, 12)
    _, ref_grads = loss_and_grads(reference, batch)
    _, grads = loss_and_grads(model, batch)
    assert max_error(grads, ref_grads) > 1e-3


def test_interleaved_forwards():
    """Per-forward data with the forward: two training forwards (different lengths) and an eval
    forward before either backward; each backward equals its own reference, and the second forward's
    saved inputs took buffers of their own."""
    reference = build(4)
    model = checkpointed(copy.deepcopy(reference), 2, True)
    batches = [ids(1, 12), ids(2, 16)]
    refs = [loss_and_grads(reference, b) for b in batches]
    model.zero_grad(set_to_none=True)
    losses = [model(input_ids=b, labels=b).loss for b in batches]
    model.eval()
    with torch.no_grad():
        model(input_ids=ids(3, 8))
    model.train()
    for loss, (ref_loss, ref_grads) in zip(losses, refs):
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        assert abs(loss.detach() - ref_loss) <= 1e-12 * abs(ref_loss)
        assert max_error(grads, ref_grads) <= 1e-12
    assert [len(pair.store._free) for pair in model.upipe_checkpoint_pairs] == [2, 2]


def _memory(pairs: int, seq: int = 2048) -> tuple[int, int]:
    """(bytes held after the forward, peak bytes of forward + backward less weights and gradients),
    MemTracker, checkpoints kept where a CPU accelerator keeps them (the tensors themselves)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = checkpointed(build(5, attention="sdpa"), pairs, offload=False)
    batch = ids(1, seq)[:1]
    tracker = MemTracker()
    tracker._mod_tracker = NoModuleTracking()
    tracker.track_external(model)
    with tracker:
        loss = model(input_ids=batch, labels=batch).loss
        after_forward = next(iter(tracker.get_tracker_snapshot().values()))["Total"]
        loss.backward()
        del loss
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return after_forward, peak["Total"] - peak.get("Parameter", 0) - peak.get("Gradient", 0)


def test_one_hidden_state_fewer_per_pair():
    hidden_state = 2048 * HIDDEN * 8
    (kept0, peak0), (kept1, peak1), (kept2, peak2) = (_memory(n) for n in (0, 1, 2))
    assert kept0 - kept1 == hidden_state and kept0 - kept2 == 2 * hidden_state
    # the step's peak (the top layer's backward, every checkpoint below it resident) drops with the first pair
    assert peak0 - peak1 == hidden_state
    assert peak2 <= peak1


def test_refusals():
    with pytest.raises(ValueError, match=r"upipe.checkpoint_pairs: got 1 without activation checkpointing"):
        parse_config({"upipe": {"checkpoint_pairs": 1}})
    with pytest.raises(ValueError, match=r"upipe.checkpoint_pairs: got -1; allowed: an int >= 0"):
        parse_config({"upipe": {"checkpoint_pairs": -1}, "activation_checkpointing": {}})
    with pytest.raises(ValueError, match=r"partition_activations=true"):
        parse_config({"upipe": {"checkpoint_pairs": 1}, "activation_checkpointing": {"partition_activations": True}})
    settings = parse_config({"upipe": {"checkpoint_pairs": 2}, "activation_checkpointing": {}})
    with pytest.raises(ValueError, match=r"got 2 for a model with 3 checkpointable decoder layers; allowed: 0 to 1"):
        check_model_settings(build(3), settings)
    check_model_settings(build(4), settings)

    model = checkpointed(build(2), 1, False)
    layers = model.model.layers
    with pytest.raises(RuntimeError, match=r"decoder layer 1 was called with an input that is not decoder layer 0"):
        layers[1](torch.randn(1, 4, HIDDEN, dtype=torch.float64, requires_grad=True))
    with pytest.raises(ValueError, match=r"the input of decoder layer 0 does not require grad"):
        layers[0](torch.randn(1, 4, HIDDEN, dtype=torch.float64))
