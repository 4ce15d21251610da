"""What the mixer kinds share: the refusals' wording and the rule for U, the model's own functions, packed
documents on kernels that ignore them, and the causal-conv1d call (with the CUDA kernel's argument contract,
checked on every device so a CPU run catches a call the GPU kernel would reject)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ds_upipe.packing import DocumentBoundaries

#: causal-conv1d's kernels take these widths only (``causal_conv1d_fwd``'s check)
CONV_KERNEL_WIDTHS = (2, 3, 4)
#: the dtypes its CUDA kernels take for x, weight and bias
CONV_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def refusal(layer: int, module: nn.Module, why: str) -> ValueError:
    """The error of a mixer UPipe cannot run, naming the layer and its class (raised in ``check``)."""
    return ValueError(f"apply_upipe: decoder layer {layer} ({type(module).__name__}): {why}")


def valid_head_chunk_sizes(num_heads: int, group_size: int) -> list[int]:
    """The U a mixer of ``num_heads`` heads runs with over ``group_size`` ranks: multiples of C dividing the heads."""
    return [u for u in range(group_size, num_heads + 1, group_size) if num_heads % u == 0]


def check_head_chunk_size(
    layer: int, module: nn.Module, heads: str, num_heads: int, group_size: int, head_chunk_size: int | None
) -> int:
    """U (None: C), or the refusal naming the value, the rule and the valid values; ``heads`` names them."""
    u = group_size if head_chunk_size is None else head_chunk_size
    valid = valid_head_chunk_sizes(num_heads, group_size)
    if u in valid:
        return u
    rule = (
        f"Valid values: {', '.join(map(str, valid))}"
        if valid
        else f"no valid value: the group size {group_size} does not divide {heads}={num_heads}"
    )
    raise refusal(
        layer,
        module,
        f"mixer_head_chunk_size={head_chunk_size} (U={u}): U must be a multiple of the group size {group_size} "
        f"dividing {heads}={num_heads}. {rule}",
    )


@torch.compiler.disable
def checkpointed_stage(stage: Callable[..., Tensor], *args: object) -> Tensor:
    """``stage(*args)`` under a non-reentrant checkpoint (between forward and backward a mixer stage keeps its
    input, shared, and its local output only), run eagerly under ``torch.compile``: a graph break before and after
    the stage, which autograd links like any other node (as the attention stage loop's ``apply_eagerly``).

    Why eager: dynamo traces a checkpoint whole (a higher-order op) or not at all (torch's ``checkpoint`` is
    dynamo-disabled, so any graph break inside runs the whole stage eagerly), and on GPU a stage calls FLA's
    ``chunk_gated_delta_rule``, which is ``torch.compiler.disable``d: made explicit here, CPU and GPU runs compile
    the same pieces.  Traced whole on transformers' torch fallbacks, the tiny Qwen3.5 of tests/test_compile.py
    (4 gated delta stages, aot_eager) took 95-175 s to compile against 10-35 s for its unpatched model on the whole
    sequence, once a stage.  Eager, the stage's exchanges (collectives inside autograd Functions, the pattern that
    lost gradients in DeepSpeed #8491) never enter a graph either."""
    return checkpoint(stage, *args, use_reentrant=False)


def model_function(module: nn.Module, *names: str) -> Callable[..., Tensor]:
    """The module-level function the module's own modeling file calls (first of ``names`` it defines), looked
    up at call time: transformers' wrapper runs the CUDA kernel where its package is installed, its torch
    fallback otherwise."""
    source = sys.modules[type(module).__module__]
    for name in names:
        fn = getattr(source, name, None)
        if fn is not None:
            return fn
    raise ValueError(f"{type(module).__module__} defines none of {', '.join(names)}")


def kernel_runs(package: str, device: torch.device) -> bool:
    """Whether transformers' kernel-with-fallback wrapper runs the package's CUDA kernel (which honours
    ``seq_idx``) rather than its torch code (which refuses ``seq_idx``): installed, and inputs on CUDA."""
    return device.type == "cuda" and _installed(package)


@functools.cache
def _installed(package: str) -> bool:
    """Whether ``package`` can be imported: asked once a process (every mixer stage's conv and scan ask)."""
    return importlib.util.find_spec(package) is not None


def per_document(run: Callable[..., Tensor], documents: DocumentBoundaries | None, *inputs: Tensor) -> Tensor:
    """``run`` on each document of each row alone, outputs joined along dim 1 (tokens, of every input).  The
    torch fallbacks ignore cu_seqlens / seq_idx, so running each document by itself is how their state
    restarts (a correct, if slower, call of the CUDA kernels too)."""
    if documents is None or documents.is_trivial:
        return run(*inputs)
    rows = []
    for b, row in enumerate(documents.for_batch(inputs[0].shape[0])):
        parts = [run(*(t[b : b + 1, s:e] for t in inputs)) for s, e in zip(row, row[1:])]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows)


def seq_idx_of(documents: DocumentBoundaries, batch: int, seq: int, device: torch.device) -> Tensor:
    """[B, T] int32 document index of every token (mamba_ssm / causal-conv1d restart where it changes)."""
    idx = torch.zeros(batch, seq, dtype=torch.int32)
    for b, row in enumerate(documents.for_batch(batch)):
        for start in row[1:-1]:
            idx[b, start:] += 1
    return idx.to(device)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"causal_conv1d: {message}")


def check_causal_conv1d_arguments(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None, on_kernel_device: bool | None = None
) -> None:
    """What causal-conv1d's ``causal_conv1d_fn`` requires of its arguments (csrc/causal_conv1d.cpp,
    ``causal_conv1d_fwd``): x [B, D, T] with time or channels at stride 1 (channel-last: D and the other
    strides multiples of 8), weight [D, W] with W in 2..4, bias [D] at stride 1 in weight's dtype, seq_idx
    int32 [B, T] contiguous and only with channel-last x.  Dtypes are checked where the kernel runs
    (``on_kernel_device``, default: x on CUDA); elsewhere transformers runs its torch fallback, which takes
    any floating dtype.  ValueError naming the rule."""
    _require(x.dim() == 3, f"x must be [batch, dim, seqlen], got {tuple(x.shape)}")
    batch, dim, seqlen = x.shape
    _require(weight.dim() == 2 and weight.shape[0] == dim, f"weight must be [{dim}, width], got {tuple(weight.shape)}")
    _require(weight.shape[1] in CONV_KERNEL_WIDTHS, f"width {weight.shape[1]}: the kernel supports widths 2 to 4")
    _require(x.stride(2) == 1 or x.stride(1) == 1, f"x needs stride 1 over time or channels, got {x.stride()}")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        _require(dim % 8 == 0, f"channel-last x needs dim divisible by 8, got {dim}")
        _require(
            x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, f"channel-last x strides {x.stride()}: need multiples of 8"
        )
    if bias is not None:
        _require(tuple(bias.shape) == (dim,), f"bias must be [{dim}], got {tuple(bias.shape)}")
        _require(bias.dtype == weight.dtype, f"bias dtype {bias.dtype} != weight dtype {weight.dtype}")
        _require(bias.stride(-1) == 1, f"bias must have stride 1, got {bias.stride()}")
    if seq_idx is not None:
        _require(channel_last, "seq_idx is only supported for channel-last x (stride(1) == 1)")
        _require(seq_idx.dtype == torch.int32, f"seq_idx must be int32, got {seq_idx.dtype}")
        _require(seq_idx.is_contiguous(), "seq_idx must be contiguous")
        _require(tuple(seq_idx.shape) == (batch, seqlen), f"seq_idx must be [{batch}, {seqlen}], got {seq_idx.shape}")
    if x.is_cuda if on_kernel_device is None else on_kernel_device:
        for name, t in (("x", x), ("weight", weight), ("bias", bias)):
            _require(
                t is None or t.dtype in CONV_KERNEL_DTYPES,
                f"{name} dtype {t.dtype}: the kernel takes {CONV_KERNEL_DTYPES}",
            )


def _row_major(t: Tensor) -> Tensor:
    """``t`` with row-major strides: ``contiguous()`` keeps any stride of a size-1 dim (a one-token document),
    which the kernel's channel-last check reads."""
    strides = [1] * t.dim()
    for d in range(t.dim() - 2, -1, -1):
        strides[d] = strides[d + 1] * t.shape[d + 1]
    return t if t.stride() == tuple(strides) else t.new_empty(t.shape).copy_(t)


def causal_conv(
    module: nn.Module,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    activation: str | None,
    documents: DocumentBoundaries | None = None,
) -> Tensor:
    """The model's ``causal_conv1d_fn`` over ``x`` [B, T, D] -> [B, T, D] (depthwise ``weight`` [D, W]),
    restarting at each document start: x goes channel-last ([B, D, T] the transpose of a contiguous [B, T, D],
    as the modules pass it: the only layout the kernel takes ``seq_idx`` in, for D a multiple of 8; otherwise
    [B, D, T] contiguous), ``seq_idx`` where the CUDA kernel runs, one call per document on the torch fallback."""
    conv = model_function(module, "causal_conv1d_fn")
    kernel = kernel_runs("causal_conv1d", x.device)
    channel_last = x.shape[-1] % 8 == 0

    def run(part: Tensor, seq_idx: Tensor | None = None) -> Tensor:
        channels = _row_major(part).transpose(1, 2) if channel_last else _row_major(part.transpose(1, 2))
        check_causal_conv1d_arguments(channels, weight, bias, seq_idx, on_kernel_device=kernel)
        extra = {} if seq_idx is None else {"seq_idx": seq_idx}
        return conv(channels, weight, bias, activation=activation, **extra).transpose(1, 2)

    if documents is not None and not documents.is_trivial and kernel and channel_last:
        return run(x, seq_idx_of(documents, x.shape[0], x.shape[1], x.device))
    return per_document(run, documents, x)
