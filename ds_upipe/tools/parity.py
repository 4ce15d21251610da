"""One parity step, shared by the tests and ``ds-upipe sweep``: a patched model on this rank's sequence shard
against the same model unpatched on the whole sequence in one process (logits, loss, every parameter gradient
summed over the ranks), and the relative errors between them.

``float64_internals`` keeps transformers' internal float32 casts in float64 while a comparison runs, so that
float64 parity can hold at 1e-10 for models that compute parts in float32 on purpose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_patches

#: gradients below this fraction of the model's largest are compared on that scale (``compare``)
GRADIENT_FLOOR = 1e-6


def make_batch(seed: int, batch: int, seq: int, vocab: int = 101) -> dict:
    """Random token rows with labels (the first fifth ignored)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels = ids.clone()
    labels[:, : seq // 5] = -100  # some ignored tokens, unevenly spread over the ranks
    return {"input_ids": ids, "labels": labels}


def relative_error(got, want, floor: float = 1e-30) -> float:
    """max |got - want| over max |want| (at least ``floor``)."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def reference_loss(logits, labels):
    """Mean next-token cross-entropy over the non-ignored tokens (in the logits' dtype)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), hf_patches.shift_labels(labels).reshape(-1), ignore_index=-100
    )


def reference_step(model, batch):
    """The unpatched model on the whole sequence: logits, loss and parameter gradients."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch["input_ids"])
    loss = reference_loss(out.logits, batch["labels"])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), loss.detach(), grads


def summed_grads(model, group):
    """The model's parameter gradients (copies) summed over ``group``, by name."""
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=group)
            grads[name] = g
    return grads


def sharded_step(model, batch, group, grad_reduction="sum", ring_size=1):
    """The patched model on this rank's shard; gradients summed over the ranks (``group``: the whole
    sequence-parallel group, C_u x R ranks with a ring)."""
    model.zero_grad(set_to_none=True)
    shard = hf_patches.shard_batch(batch, group, ring_size=ring_size)
    out = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"])
    loss = hf_patches.sequence_parallel_loss(out.logits, shard["shift_labels"], group, grad_reduction=grad_reduction)
    loss.backward()
    grads = summed_grads(model, group)
    logits = hf_patches.gather_sequence(out.logits.detach(), group, ring_size=ring_size)
    return logits, loss.detach(), grads


def compare(ref, got, seq: int) -> dict[str, float]:
    (r_logits, r_loss, r_grads), (g_logits, g_loss, g_grads) = ref, got
    errors = {"logits": relative_error(g_logits[:, :seq], r_logits), "loss": relative_error(g_loss, r_loss)}
    if set(r_grads) != set(g_grads):
        errors["grad_names"] = float("inf")
    # a gradient that is zero up to rounding (a key bias: softmax ignores a shift shared by all keys) is compared
    # on the scale of the model's largest gradient, not on its own rounding noise
    floor = GRADIENT_FLOOR * max(g.abs().max().item() for g in r_grads.values())
    errors["grads"] = max(relative_error(g_grads[n], r_grads[n], floor) for n in r_grads)
    return errors


@contextlib.contextmanager
def float64_internals(integers: bool = False) -> Iterator[None]:
    """``Tensor.float()`` and ``Tensor.to(torch.float32)`` keep float64 tensors float64 while the cases run
    (reference and patched alike); ``integers``: ``.float()`` of an integer or bool tensor gives float64 too
    (Gemma 4's vision pooler multiplies one-hot ``.float()`` weights into its float64 features).  transformers'
    torch SSD scan casts x, B, C and dt to float32 (as the CUDA kernels compute) and Nemotron-H's RMSNorm and
    logits are float32; their float32 sums split over ranks (a group's B/C gradient summed over its heads, a norm
    weight's over the tokens) differ from the whole sum by ~1e-7, so float64 parity at 1e-10 needs them kept in
    float64.  DeepSeek's routers cast with ``Tensor.type(torch.float32)`` (kept too).  No hook sets these
    internal dtypes."""
    original_float, original_to, original_type = torch.Tensor.float, torch.Tensor.to, torch.Tensor.type

    def keep_float(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if integers and not self.is_floating_point() and not self.is_complex():
            return original_to(self, torch.float64)
        return self if self.dtype == torch.float64 else original_float(self, *args, **kwargs)

    def keep_to(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        only_float32 = (args == (torch.float32,) and not kwargs) or (not args and kwargs == {"dtype": torch.float32})
        return self if self.dtype == torch.float64 and only_float32 else original_to(self, *args, **kwargs)

    def keep_type(self: torch.Tensor, *args, **kwargs) -> torch.Tensor | str:
        only_float32 = args == (torch.float32,) and not kwargs
        return self if self.dtype == torch.float64 and only_float32 else original_type(self, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.to, torch.Tensor.type = keep_float, keep_to, keep_type
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to, torch.Tensor.type = original_float, original_to, original_type
