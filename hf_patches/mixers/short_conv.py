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

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ds_upipe.packing import DocumentBoundaries

from .common import CONV_KERNEL_WIDTHS, causal_conv, refusal
from .exchange import previous_tokens


def check(layer: int, module: nn.Module, group_size: int, head_chunk_size: int | None) -> None:
    """Refuse what the sharded conv cannot run: a head chunk size (no heads), a conv that is not
    depthwise over in_proj's thirds, a width causal-conv1d does not take."""
    if head_chunk_size is not None:
        raise refusal(
            layer,
            module,
            f"mixer_head_chunk_size={head_chunk_size} does not apply: a short convolution has no heads (each rank "
            "convolves its own tokens with a halo from the rank before); pass mixer_head_chunk_size=None",
        )
    conv, dim = module.conv, module.out_proj.in_features
    if not (conv.in_channels == conv.out_channels == conv.groups == dim and module.in_proj.out_features == 3 * dim):
        raise refusal(
            layer,
            module,
            f"conv {conv.in_channels}->{conv.out_channels} channels in {conv.groups} groups, in_proj "
            f"{module.in_proj.out_features} features: the sharded forward needs a depthwise conv over {dim} channels "
            f"and in_proj of 3 x {dim} (B, C, x)",
        )
    width = conv.kernel_size[0]
    if width not in CONV_KERNEL_WIDTHS:
        raise refusal(
            layer,
            module,
            f"conv_L_cache={width}: causal-conv1d's kernel takes widths {', '.join(map(str, CONV_KERNEL_WIDTHS))} "
            "(the conv's halo is width - 1 tokens of the previous rank)",
        )


def head_count(module: nn.Module) -> None:
    """No heads: U does not apply (``mixer_head_chunk_size`` stays None)."""
    return None


def zero3_params(module: nn.Module) -> list[nn.Parameter]:
    """The conv's weight and bias: read by the conv function, outside ``module.conv``'s forward (as the
    unpatched module does); in_proj and out_proj run as modules."""
    return [p for p in (module.conv.weight, module.conv.bias) if p is not None]


def _check_shard(module: nn.Module, seq: int, group_size: int) -> None:
    """A halo must come from one rank: refuse shards shorter than W - 1 (same S and C, so same message, on
    every rank, before the halo's collective)."""
    halo = module.conv.kernel_size[0] - 1
    if seq < halo:
        raise refusal(
            module.layer_idx,
            module,
            f"a sequence of {seq * group_size} tokens over {group_size} ranks "
            f"gives shards of {seq} tokens, fewer than the conv's halo of conv_L_cache - 1 = {halo} tokens from the "
            f"previous rank; use sequences of at least {halo * group_size} tokens",
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
    """The module's conv over ``window`` [B, T, D] -> [B, T, D], as the module calls it (no activation)."""
    return causal_conv(module, window, module.conv.weight.squeeze(1), module.conv.bias, None)


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
