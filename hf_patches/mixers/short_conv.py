"""Short gated convolutions (LFM2's ``Lfm2ShortConv``, LFM2-MoE's ``Lfm2MoeShortConv``) on sequence shards.

The layer is position-wise but for one depthwise causal conv1d of width W = ``conv_L_cache``:
``B, C, x = in_proj(h)``, ``y = out_proj(C * conv(B * x))``.  So it has no heads and needs no
all-to-all: each rank projects its own tokens, takes the last W - 1 conv inputs of the rank before it
(``exchange.previous_tokens``, which also sends their gradient back) and runs the model's own conv
function over [halo, local], keeping the local outputs.

Packed documents restart the conv at each document start: W - 1 zeros are put in front of every
document start inside the conv's window, which is exactly the left zero padding a lone document gets,
so any conv implementation (causal-conv1d's kernel or transformers' torch fallback, which refuses
``seq_idx``) computes every document as if alone, in one call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_upipe.packing import DocumentBoundaries

from .exchange import previous_tokens

#: causal-conv1d's kernels take these widths only (``causal_conv1d_fwd``'s check)
KERNEL_WIDTHS = (2, 3, 4)
#: the dtypes its CUDA kernels take for x, weight and bias
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _where(layer: int, module: nn.Module) -> str:
    return f"apply_upipe: decoder layer {layer} ({type(module).__name__})"


def check(layer: int, module: nn.Module, group_size: int, head_chunk_size: int | None) -> None:
    """Refuse what the sharded conv cannot run: a head chunk size (no heads), a conv that is not
    depthwise over in_proj's thirds, a width causal-conv1d does not take."""
    if head_chunk_size is not None:
        raise ValueError(
            f"{_where(layer, module)}: mixer_head_chunk_size={head_chunk_size} does not apply: a short convolution "
            "has no heads (each rank convolves its own tokens with a halo from the rank before); pass "
            "mixer_head_chunk_size=None"
        )
    conv, dim = module.conv, module.out_proj.in_features
    if not (conv.in_channels == conv.out_channels == conv.groups == dim and module.in_proj.out_features == 3 * dim):
        raise ValueError(
            f"{_where(layer, module)}: conv {conv.in_channels}->{conv.out_channels} channels in {conv.groups} groups, "
            f"in_proj {module.in_proj.out_features} features: the sharded forward needs a depthwise conv over "
            f"{dim} channels and in_proj of 3 x {dim} (B, C, x)"
        )
    width = conv.kernel_size[0]
    if width not in KERNEL_WIDTHS:
        raise ValueError(
            f"{_where(layer, module)}: conv_L_cache={width}: causal-conv1d's kernel takes widths "
            f"{', '.join(map(str, KERNEL_WIDTHS))} (the conv's halo is width - 1 tokens of the previous rank)"
        )


def zero3_params(module: nn.Module) -> list[nn.Parameter]:
    """The conv's weight and bias: read by the conv function, outside ``module.conv``'s forward (as the
    unpatched module does); in_proj and out_proj run as modules."""
    return [p for p in (module.conv.weight, module.conv.bias) if p is not None]


def check_causal_conv1d_arguments(x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None) -> None:
    """What causal-conv1d's ``causal_conv1d_fn`` requires of its arguments (csrc/causal_conv1d.cpp,
    ``causal_conv1d_fwd``), checked on any device so a CPU run catches a call the GPU kernel would reject:
    x [B, D, T] with time or channels at stride 1 (channel-last: D and the other strides multiples of 8),
    weight [D, W] with W in 2..4, bias [D] at stride 1 in weight's dtype, seq_idx int32 [B, T]
    contiguous and only with channel-last x.  Dtypes are checked where the kernel runs (CUDA tensors);
    elsewhere transformers runs its torch fallback, which takes any floating dtype."""
    assert x.dim() == 3, f"x must be [batch, dim, seqlen], got {tuple(x.shape)}"
    batch, dim, seqlen = x.shape
    assert weight.dim() == 2 and weight.shape[0] == dim, f"weight must be [{dim}, width], got {tuple(weight.shape)}"
    assert weight.shape[1] in KERNEL_WIDTHS, f"width {weight.shape[1]}: causal_conv1d supports widths 2 to 4"
    assert x.stride(2) == 1 or x.stride(1) == 1, f"x needs stride 1 over time or channels, got {x.stride()}"
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        assert dim % 8 == 0, f"channel-last x needs dim divisible by 8, got {dim}"
        assert x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, (
            f"channel-last x strides {x.stride()}: need multiples of 8"
        )
    if bias is not None:
        assert tuple(bias.shape) == (dim,), f"bias must be [{dim}], got {tuple(bias.shape)}"
        assert bias.dtype == weight.dtype, f"bias dtype {bias.dtype} != weight dtype {weight.dtype}"
        assert bias.stride(-1) == 1, f"bias must have stride 1, got {bias.stride()}"
    if seq_idx is not None:
        assert channel_last, "seq_idx is only supported for channel-last x (stride(1) == 1)"
        assert seq_idx.dtype == torch.int32, f"seq_idx must be int32, got {seq_idx.dtype}"
        assert seq_idx.is_contiguous(), "seq_idx must be contiguous"
        assert tuple(seq_idx.shape) == (batch, seqlen), f"seq_idx must be [{batch}, {seqlen}], got {seq_idx.shape}"
    if x.is_cuda:
        for name, t in (("x", x), ("weight", weight), ("bias", bias)):
            assert t is None or t.dtype in KERNEL_DTYPES, f"{name} dtype {t.dtype}: causal_conv1d takes {KERNEL_DTYPES}"


def _conv_function(module: nn.Module) -> Callable[..., Tensor]:
    """The module's own ``causal_conv1d_fn`` (its model file's, dispatching to causal-conv1d when installed)."""
    return sys.modules[type(module).__module__].causal_conv1d_fn


def _check_shard(module: nn.Module, seq: int, group_size: int) -> None:
    """A halo must come from one rank: refuse shards shorter than W - 1 (same S and C, so same message, on
    every rank, before the halo's collective)."""
    halo = module.conv.kernel_size[0] - 1
    if seq < halo:
        raise ValueError(
            f"{_where(module.layer_idx, module)}: a sequence of {seq * group_size} tokens over {group_size} ranks "
            f"gives shards of {seq} tokens, fewer than the conv's halo of conv_L_cache - 1 = {halo} tokens from the "
            f"previous rank; use sequences of at least {halo * group_size} tokens"
        )


def _document_layout(
    documents: DocumentBoundaries, batch: int, first: int, length: int, halo: int, device: torch.device
) -> tuple[Tensor, int] | None:
    """Where each token of the conv window (global positions [first, first + length)) goes once ``halo``
    zeros precede every document start inside it: [batch, length] positions, and the longest row's length
    (shorter rows end in zeros, which a causal conv's kept outputs never read).  None: no start inside."""
    inside = [[g - first for g in cu[1:-1] if first < g < first + length] for cu in documents.for_batch(batch)]
    if not any(inside):
        return None
    starts = torch.zeros(batch, length, dtype=torch.long)  # built on the host from the boundaries: no device sync
    for row, columns in enumerate(inside):
        starts[row, columns] = 1
    shift = halo * starts.cumsum(1)  # zeros before this token's and every earlier start in the window
    return (torch.arange(length) + shift).to(device), length + int(shift[:, -1].max())


def _conv(module: nn.Module, window: Tensor) -> Tensor:
    """The module's conv over ``window`` [B, T, D] -> [B, T, D], as the module calls it: channel-last
    [B, D, T] (its B * x is), contiguous where the kernel would refuse that layout."""
    x = window.transpose(1, 2)
    if x.shape[1] % 8:
        x = x.contiguous()
    weight, bias = module.conv.weight.squeeze(1), module.conv.bias
    check_causal_conv1d_arguments(x, weight, bias, None)
    return _conv_function(module)(x, weight, bias, activation=None).transpose(1, 2)


def sharded_forward(
    module: nn.Module,
    hidden_states: Tensor,
    *,
    group: dist.ProcessGroup | None,
    head_chunk_size: int | None,
    documents: DocumentBoundaries | None,
) -> Tensor:
    """``module``'s output on this rank's shard [B, s, D]; equals the unpatched module on the whole
    sequence (each packed document alone).  ``head_chunk_size`` is None (``check``)."""
    batch, seq, _ = hidden_states.shape
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_shard(module, seq, size)
    halo = module.conv.kernel_size[0] - 1
    gate_b, gate_c, x = module.in_proj(hidden_states).chunk(3, dim=-1)
    bx = gate_b * x
    window = torch.cat([previous_tokens(bx, halo, group), bx], dim=1)  # global [rank * s - halo, (rank + 1) * s)
    layout = None
    if documents is not None and not documents.is_trivial:
        layout = _document_layout(documents, batch, rank * seq - halo, seq + halo, halo, bx.device)
    if layout is None:
        conv_out = _conv(module, window)[:, halo:]
    else:
        positions, total = layout
        rows = torch.arange(batch, device=bx.device)[:, None]
        spread = window.new_zeros(batch, total, window.shape[-1]).index_put((rows, positions), window)
        conv_out = _conv(module, spread)[rows, positions[:, halo:]]
    return module.out_proj(gate_c * conv_out)
