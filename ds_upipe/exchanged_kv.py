"""Keys and values exchanged once for several attention layers (transformers' KV-shared layers: Gemma 3n, Gemma 4).

A KV-shared layer attends with the keys and values of an earlier layer of its type (the producer).  Exchanging
them again in every sharing layer (as ``UPipeAttentionFunction`` does with whatever K/V it is given) repeats the
producer's all-to-alls: a round's K/V per layer in forward and again in backward, and dK/dV back per layer.
Here the producer's K/V go through one ``KeyValueExchange`` node: the KV heads of every round of its plan that
this rank attends with, over the whole sequence, in one all-to-all ([b, max(1, Hkv / C), S, d] each: the rank's
KV heads, or the one replica it attends with where Hkv < C).  Each layer (the producer's own call too) attends
with them through ``ExchangedKeyValueAttention``, which exchanges queries and outputs per stage as usual, and
returns its dK/dV in the full-sequence layout; autograd sums the layers' dK/dV, and the exchange's backward sends
the sum back to the sequence shards in one all-to-all.

The trade-off: the exchanged K/V are saved by every layer's node, so they stay alive from the producer's forward
to its backward (S * max(1, Hkv / C) * (d + d_v) elements per batch row and producer), where the re-exchanging
path keeps only the local shards.  ``UPipeOptions.share_exchanged_kv`` chooses (docs/hf_patches.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from .pipeline import (
    ExchangedKeyValue,
    LocalTensorSource,
    PipelineContext,
    _hand_over,
    pipeline_backward,
    pipeline_forward,
)
from .sinks import find_sink_kernel


class KeyValueExchange(torch.autograd.Function):
    """Local K, V ([b, s, Hkv, d], [b, s, Hkv, d_v]) -> this rank's KV heads of every round of ``pctx.plan`` over
    the whole sequence ([b, n, S, d], [b, n, S, d_v]; ``ExchangedKeyValue``), in one all-to-all; backward: their
    gradient, summed by autograd over every layer that attended with them, back in one all-to-all (replicas of a KV
    head, Hkv < C, summed into the one local head)."""

    @staticmethod
    def forward(fctx, key: Tensor, value: Tensor, pctx: PipelineContext) -> tuple[Tensor, Tensor]:
        source = LocalTensorSource(key, key, value)  # its key/value side only
        with torch.no_grad():
            k_all, v_all = pctx.gather_key_value(source, pctx.every_round_slot())
        fctx.pctx = pctx
        fctx.save_for_backward(key, value)
        return k_all, v_all

    @staticmethod
    def backward(fctx, grad_key: Tensor, grad_value: Tensor):
        key, value = fctx.saved_tensors
        pctx: PipelineContext = fctx.pctx
        source = LocalTensorSource(key, key, value)
        with torch.no_grad():
            local = pctx.scatter([grad_key, grad_value], key.dtype)
            _hand_over(source.add_key_value_grad, pctx.every_round_slot(), local, True)
        return source.grad_k, source.grad_v, None


class ExchangedKeyValueAttention(torch.autograd.Function):
    """``UPipeAttentionFunction`` on local queries ([b, s, H, d]) and keys and values already exchanged
    (``KeyValueExchange``'s outputs): the stages exchange queries, outputs and their gradients; dK/dV come back
    in the exchanged layout, summed over the stages in the accumulation dtype (``PipelineContext.accumulate_dtype``)."""

    @staticmethod
    def forward(
        fctx, query: Tensor, key: Tensor, value: Tensor, pctx: PipelineContext, sinks: Tensor | None = None
    ) -> Tensor:
        out = torch.empty((*query.shape[:-1], value.shape[-1]), dtype=query.dtype, device=query.device)
        exchanged = ExchangedKeyValue(key, value, len(pctx.plan.rounds))
        with torch.no_grad():
            saved = pipeline_forward(pctx, _QuerySource(query, value.shape[-1]), out, exchanged)
        fctx.pctx = pctx
        fctx.save_for_backward(query, key, value, out, *saved)
        return out

    @staticmethod
    def backward(fctx, grad_out: Tensor):
        query, key, value, out, *saved = fctx.saved_tensors
        pctx: PipelineContext = fctx.pctx
        acc = pctx.accumulate_dtype(key.dtype)
        grads = (
            torch.zeros(key.shape, dtype=acc, device=key.device),
            torch.zeros(value.shape, dtype=acc, device=key.device),
        )
        source = _QuerySource(query, value.shape[-1])
        with torch.no_grad():
            exchanged = ExchangedKeyValue(key, value, len(pctx.plan.rounds), grads)
            pipeline_backward(pctx, source, out, grad_out, saved, exchanged)
        sink_kernel = find_sink_kernel(pctx.attention)
        return (
            source.grad_q,
            grads[0].to(key.dtype),
            grads[1].to(value.dtype),
            None,
            None if sink_kernel is None else sink_kernel.grad,
        )


class _QuerySource(LocalTensorSource):
    """Local queries only: the stage loop takes every round's keys and values from its ``ExchangedKeyValue``."""

    def __init__(self, query: Tensor, value_head_dim: int) -> None:
        super().__init__(query, query, query)  # no local keys and values: key_value is never asked for
        self.value_head_dim = value_head_dim
