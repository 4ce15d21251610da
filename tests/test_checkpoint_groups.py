"""upipe.checkpoint_groups / checkpoint_pairs (ds_upipe.integration.checkpoint_groups): exact (float64, dropout,
packed rows), k - 1 hidden states fewer per group of k, per-forward data with the forward, and clear refusals.  In
one process: the groups act on the layers, whatever the attention; their launch through a real ZeRO-3 engine is in
test_engine_launch."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

pytest.importorskip("deepspeed")
import transformers  # noqa: E402
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing  # noqa: E402

from ds_upipe.integration import checkpoint_groups  # noqa: E402
from ds_upipe.integration.checkpoint_groups import install_checkpoint_groups  # noqa: E402
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


def checkpointed(model, groups: int, offload: bool, size: int = 2):
    """As ``configure_activation_checkpointing`` installs it: DeepSpeed's checkpoint (replayed output
    released) on every layer, the lowest groups * size in groups of size."""
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=releasing(ds_checkpointing.checkpoint))
    model.enable_input_require_grads()
    install_checkpoint_groups(model, groups, size, offload)
    return model


def ids(seed: int, seq: int) -> torch.Tensor:
    return torch.randint(0, 101, (2, seq), generator=torch.Generator().manual_seed(seed))


def packed_positions(seq: int) -> torch.Tensor:
    """Packed rows: three documents per row, positions restarting at each (transformers' packed-sequence path)."""
    cuts = [0, 5, seq - 3, seq]
    row = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])
    return torch.stack([row, row.roll(2)])


def loss_and_grads(model, batch, rng_seed: int = 5, packed: bool = False):
    torch.manual_seed(rng_seed)  # the dropout masks: the same in the reference and the checkpointed run
    model.zero_grad(set_to_none=True)
    positions = {"position_ids": packed_positions(batch.shape[1])} if packed else {}
    loss = model(input_ids=batch, labels=batch, **positions).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def max_error(got: dict, want: dict) -> float:
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


# (layers, groups, size, offload, attention dropout, packed rows): pairs with DeepSpeed layers above them, every
# layer paired, the host-copy store, dropout (each replay must reproduce its forward's masks); groups of 3 and 4
# (inner inputs), every layer grouped, packed rows
CASES = [
    (5, 2, 2, True, 0.0, False),
    (4, 2, 2, False, 0.0, False),
    (3, 1, 2, True, 0.3, False),
    (7, 2, 3, True, 0.3, True),
    (4, 1, 4, False, 0.3, False),
    (9, 2, 4, True, 0.3, True),
]


def _parity(layers: int, groups: int, size: int, offload: bool, dropout: float, packed: bool):
    """(loss error, gradient error, model) of the grouped model against plain float64 autograd."""
    reference = build(layers, dropout)
    model = checkpointed(copy.deepcopy(reference), groups, offload, size)
    batch = ids(1, 12)
    ref_loss, ref_grads = loss_and_grads(reference, batch, packed=packed)
    loss, grads = loss_and_grads(model, batch, packed=packed)
    return (abs(loss - ref_loss) / abs(ref_loss)).item(), max_error(grads, ref_grads), model


@pytest.mark.parametrize("layers,groups,size,offload,dropout,packed", CASES)
def test_float64_parity(layers, groups, size, offload, dropout, packed):
    loss_error, grad_error, model = _parity(layers, groups, size, offload, dropout, packed)
    assert loss_error <= 1e-12 and grad_error <= 1e-12
    installed = model.upipe_checkpoint_groups
    assert len(installed) == groups and all(g.backward_runs == 1 for g in installed)
    hidden_state = 2 * 12 * HIDDEN * 8
    # the host copies are exact-size buffers, back in their pools after the backward: one saved input per
    # group (its own pool), size - 2 inner inputs (one pool for all groups: backwards run one at a time)
    assert all(g.store.allocated_bytes == (hidden_state if offload else 0) for g in installed)
    assert all(len(g.store._free) == (1 if offload else 0) for g in installed)
    inner = installed[0].inner_store
    assert all(g.inner_store is inner for g in installed)
    assert inner.allocated_bytes == ((size - 2) * hidden_state if offload else 0)
    assert len(inner._free) == (size - 2 if offload else 0)


@pytest.mark.parametrize("size", [2, 4])
def test_replay_without_the_forward_rng_is_caught(monkeypatch, size):
    """The parity test can fail: replays that do not restore the forward's RNG state draw other
    dropout masks, and the gradients differ (a pair, and a group's inner layers)."""
    monkeypatch.setattr(checkpoint_groups, "replaying", lambda state: contextlib.nullcontext())
    assert _parity(size, 1, size, True, 0.3, False)[1] > 1e-3


def test_group_input_not_restored_is_caught(monkeypatch):
    """The parity test can fail: a middle layer replayed from the group's saved input instead of its own
    recomputed input gives other gradients."""
    monkeypatch.setattr(checkpoint_groups.GroupForward, "input_of", lambda self, j: self.saved.restore())
    assert _parity(4, 1, 4, True, 0.0, False)[1] > 1e-3


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
    assert [len(group.store._free) for group in model.upipe_checkpoint_groups] == [2, 2]


def _memory(pairs: int, seq: int = 2048, size: int = 2) -> tuple[int, int]:
    """(bytes held after the forward, peak bytes of forward + backward less weights and gradients),
    MemTracker, checkpoints kept where a CPU accelerator keeps them (the tensors themselves)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model = checkpointed(build(5, attention="sdpa"), pairs, offload=False, size=size)
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
    # a group of 4: 3 hidden states fewer kept after the forward
    kept4, _ = _memory(1, size=4)
    assert kept0 - kept4 == 3 * hidden_state


def test_refusals():
    with pytest.raises(ValueError, match=r"upipe.checkpoint_pairs: got 1 without activation checkpointing"):
        parse_config({"upipe": {"checkpoint_pairs": 1}})
    with pytest.raises(ValueError, match=r"upipe.checkpoint_pairs: got -1; allowed: an int >= 0"):
        parse_config({"upipe": {"checkpoint_pairs": -1}, "activation_checkpointing": {}})
    with pytest.raises(ValueError, match=r"partition_activations=true"):
        parse_config({"upipe": {"checkpoint_pairs": 1}, "activation_checkpointing": {"partition_activations": True}})
    settings = parse_config({"upipe": {"checkpoint_pairs": 2}, "activation_checkpointing": {}})
    with pytest.raises(
        ValueError, match=r"got 2 groups of 2 layers for a model with 3 checkpointable decoder layers; "
    ):
        check_model_settings(build(3), settings)
    check_model_settings(build(4), settings)
    groups = {"checkpoint_groups": 1, "checkpoint_group_size": 4}
    settings = parse_config({"upipe": groups, "activation_checkpointing": {}})
    assert settings.upipe.checkpoint_grouping == (1, 4)
    with pytest.raises(ValueError, match=r"got 1 groups of 4 layers for a model with 3 .* allowed: 0 to 0 groups of 4"):
        check_model_settings(build(3), settings)
    with pytest.raises(ValueError, match=r"upipe.checkpoint_groups: got 1 without activation checkpointing"):
        parse_config({"upipe": groups})
    with pytest.raises(ValueError, match=r"checkpoint_group_size: got 1; allowed: an int >= 2"):
        parse_config({"upipe": {"checkpoint_group_size": 1}})
    with pytest.raises(ValueError, match=r"checkpoint_pairs N is checkpoint_groups N of size 2; set one of them"):
        parse_config({"upipe": {"checkpoint_pairs": 1, **groups}, "activation_checkpointing": {}})

    model = checkpointed(build(2), 1, False)
    layers = model.model.layers
    with pytest.raises(RuntimeError, match=r"decoder layer 1 was called with an input that is not decoder layer 0"):
        layers[1](torch.randn(1, 4, HIDDEN, dtype=torch.float64, requires_grad=True))
    with pytest.raises(ValueError, match=r"the input of decoder layer 0 does not require grad"):
        layers[0](torch.randn(1, 4, HIDDEN, dtype=torch.float64))
