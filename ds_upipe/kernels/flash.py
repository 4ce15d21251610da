"""flash-attn 2 as a kernel (``FlashAttnKernel``), for the releases named in ``FLASH_ATTN_REQUIREMENT``."""

from __future__ import annotations

import importlib
import re
from types import ModuleType

import torch
from torch import Tensor

from .contract import AttentionKernel, KernelAux, common_head_dim, kernel_autograd, pad_head_dim

# -- flash-attn 2 ------------------------------------------------------------------------------------

#: flash-attn releases whose private ``_flash_attn_forward``/``_flash_attn_backward`` and
#: ``_flash_attn_varlen_forward``/``_flash_attn_varlen_backward`` this adapter calls with their exact
#: signatures, read from the v2.6.0-v2.6.3, v2.7.0, v2.7.4.post1 and v2.8.3 sources: 2.6 takes
#: ``window_size=(left, right)`` and returns (out, q, k, v, out_padded, softmax_lse, S_dmask,
#: rng_state); 2.7 and 2.8 take ``window_size_left``/``window_size_right`` and return (out,
#: softmax_lse, S_dmask, rng_state); the varlen backward returns (dq, dk, dv, softmax_d) in 2.6 and
#: softmax_d in 2.7+, filling the dq, dk, dv it is given in both.  The varlen forward's trailing
#: optional arguments differ (2.6.0: ``block_table`` without a default; 2.6.1 adds ``leftpad_k``,
#: 2.6.2 ``seqused_k``, 2.7.3 ``zero_tensors``), so the adapter passes ``block_table=None`` and leaves
#: the others at their defaults.  Keep in step with setup.py's "flash" extra.
FLASH_ATTN_REQUIREMENT = "flash-attn>=2.6,<2.9"
_FLASH_ATTN_RANGE = ((2, 6), (2, 9))


def flash_attn_release(version: str) -> tuple[int, int]:
    """(major, minor) of a flash-attn version this adapter supports; ValueError for any other."""
    match = re.match(r"(\d+)\.(\d+)", version)
    release = (int(match.group(1)), int(match.group(2))) if match else None
    if release is None or not _FLASH_ATTN_RANGE[0] <= release < _FLASH_ATTN_RANGE[1]:
        raise ValueError(
            f"kernel 'flash_attn' supports {FLASH_ATTN_REQUIREMENT}, found flash-attn {version}: the private "
            "_flash_attn_forward/_flash_attn_backward it calls change between releases; install "
            f"'{FLASH_ATTN_REQUIREMENT}' or use kernel 'sdpa'"
        )
    return release


def cuda_module_available(module: str) -> bool:
    """A CUDA kernel package can run here: CUDA is there and ``module`` imports (False on CPU machines, where
    the package's tests skip)."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def flash_attn_available() -> bool:
    """flash-attn needs CUDA and the package."""
    return cuda_module_available("flash_attn")


def _load_flash_attn() -> tuple[ModuleType, tuple[int, int]]:
    """flash-attn's interface module and its (major, minor) release, refused unless CUDA and a
    supported release are present."""
    if not flash_attn_available():
        raise ValueError(
            "kernel 'flash_attn' needs a CUDA device and the flash-attn package "
            "(pip install 'ds-upipe[flash]'); use kernel 'sdpa' instead"
        )
    import flash_attn
    from flash_attn import flash_attn_interface

    return flash_attn_interface, flash_attn_release(getattr(flash_attn, "__version__", "unknown"))


def _token_major(t: Tensor) -> Tensor:
    """[b, h, S, d] -> [b*S, h, d], flash-attn's varlen layout (the rows' tokens concatenated).

    flash-attn reads a varlen tensor through one token stride and one head stride (only the last dim
    must be contiguous), so this is a view when the tokens of all rows are evenly strided (one row, a
    single head, or token-major memory) and one copy otherwise (b > 1 rows of head-major memory)."""
    return t.transpose(1, 2).flatten(0, 1)


class FlashWindowKernel(AttentionKernel):
    """A flash-attention kernel with the library's own causal sliding window (flash-attn 2's
    ``FlashAttnKernel``, flash-attn 3's ``FA3Kernel``): ``ds_upipe.windows.windowed`` sets ``window`` on a
    copy instead of wrapping the kernel in banded tiles."""

    def __init__(self, causal: bool = True, softmax_scale: float | None = None, window: int | None = None) -> None:
        super().__init__(causal, softmax_scale)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if window is not None and not causal:
            raise ValueError(f"a sliding window is causal: {type(self).__name__}(window=...) needs causal=True")
        #: sliding window (``ds_upipe.windows``: key j visible to query i iff i - W < j <= i), None = none
        self.window = window

    def window_size(self) -> tuple[int, int]:
        """flash-attn's (left, right) window: (W - 1, 0) is query i seeing keys i - W + 1 ... i (transformers'
        sliding_window W); (-1, -1) is none."""
        return (-1, -1) if self.window is None else (self.window - 1, 0)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *args, **kwargs) -> Tensor:
        """DistributedAttention's contract; with a window through this kernel (SDPA has no window)."""
        if self.window is None:
            return super().__call__(q, k, v, *args, **kwargs)
        return kernel_autograd(self, q, k, v)

    def __repr__(self) -> str:
        extra = "" if self.window is None else f", window={self.window}"
        return f"{type(self).__name__}(causal={self.causal}, softmax_scale={self.softmax_scale}{extra})"


class FlashAttnKernel(FlashWindowKernel):
    """flash-attn 2 (``flash_attn.flash_attn_interface``, releases 2.6-2.8) on CUDA, fp16/bf16,
    native GQA, head_dim a multiple of 8 up to 256.

    flash-attn works on [b, S, h, d] and reads its inputs through their strides (only the last dim
    must be contiguous), so the adapter hands it transposed views of the kernel layout, no copies.
    It takes q, k and v of one head dim: a value head dim of its own (latent attention, v_head_dim <
    qk_head_dim) is zero-padded to q/k's (``pad_head_dim``: exact), and out, dv sliced back, as
    transformers pads MLA's value for flash-attn 2; those padded copies are the only ones.

    ``forward_varlen``/``backward_varlen`` run flash-attn's varlen functions once over many documents
    (``ds_upipe.packing.DocumentKernel`` calls them for packed rows)."""

    name = "flash_attn"

    def __init__(self, causal: bool = True, softmax_scale: float | None = None, window: int | None = None) -> None:
        super().__init__(causal, softmax_scale, window)
        self._fa, self.release = _load_flash_attn()

    def _window(self) -> dict[str, object]:
        """The sliding window in the release's own argument names (``window_size``: 2.6's pair, 2.7+'s two)."""
        left, right = self.window_size()
        return (
            {"window_size": (left, right)}
            if self.release < (2, 7)
            else {"window_size_left": left, "window_size_right": right}
        )

    @staticmethod
    def _check_inputs(q: Tensor, v: Tensor) -> int:
        """The one head dim flash-attn runs q, k and v at (v padded to it), or a ValueError."""
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"kernel 'flash_attn' runs float16 or bfloat16, got {q.dtype}; use kernel 'sdpa'")
        dim = common_head_dim(q, v)
        if dim % 8 or dim > 256:
            # flash-attn pads other head sizes inside its autograd Function, not in these calls
            raise ValueError(
                f"kernel 'flash_attn' needs head_dim a multiple of 8 and at most 256, got {q.shape[-1]} "
                f"(value head dim {v.shape[-1]}); use kernel 'sdpa'"
            )
        return dim

    @staticmethod
    def _padded(dim: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(pad_head_dim(t, dim) for t in tensors)

    def _forward_outputs(self, res: tuple) -> tuple[Tensor, Tensor, Tensor]:
        """(out, softmax_lse, rng_state) of a dense or varlen forward's return tuple: 2.6 returns
        (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state), 2.7+ (out, softmax_lse, S_dmask, rng_state)."""
        return (res[0], res[5], res[7]) if self.release < (2, 7) else (res[0], res[1], res[3])

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, KernelAux]:
        dim = self._check_inputs(q, v)
        qb, kb, vb = (t.transpose(1, 2) for t in self._padded(dim, q, k, v))
        res = self._fa._flash_attn_forward(
            qb,
            kb,
            vb,
            0.0,
            self.scale_for(q.shape[-1]),
            causal=self.causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
        )
        out, lse, rng_state = self._forward_outputs(res)
        return out.transpose(1, 2)[..., : v.shape[-1]], lse, (rng_state,)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: KernelAux
    ) -> tuple[Tensor, Tensor, Tensor]:
        (rng_state,) = aux
        dim = common_head_dim(q, v)
        qb, kb, vb, ob, db = (t.transpose(1, 2) for t in self._padded(dim, q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qb), torch.empty_like(kb), torch.empty_like(vb)
        # fills dq, dk, dv in place (dk, dv keep the hkv heads: flash-attn sums the GQA groups)
        self._fa._flash_attn_backward(
            db,
            qb,
            kb,
            vb,
            ob,
            lse,
            dq,
            dk,
            dv,
            0.0,
            self.scale_for(q.shape[-1]),
            self.causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=rng_state,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)[..., : v.shape[-1]]

    def forward_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int
    ) -> tuple[Tensor, Tensor, KernelAux]:
        """One ``_flash_attn_varlen_forward`` call for every document of the [b, h, S, d] tensors.

        ``cu_seqlens`` (int32, on q's device) are the document boundaries over the b*S tokens of the
        rows concatenated (``_token_major``), the same for queries and keys; ``max_seqlen`` is the
        longest document.  Returns out ([b, h, S, d], a view of flash-attn's token-major output),
        the lse in flash-attn's varlen layout, [h, b*S] float32 (``softmax_lse`` of ``mha_varlen_fwd``:
        ``{num_heads, total_q}``), only for ``backward_varlen``, and ``(rng_state,)``."""
        dim = self._check_inputs(q, v)
        b, _, seq, _ = q.shape
        qp, kp, vp = self._padded(dim, q, k, v)
        res = self._fa._flash_attn_varlen_forward(
            _token_major(qp),
            _token_major(kp),
            _token_major(vp),
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            0.0,
            self.scale_for(q.shape[-1]),
            causal=self.causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
            block_table=None,  # 2.6.0 has no default for it; leftpad_k, seqused_k, zero_tensors keep theirs
        )
        out, lse, rng_state = self._forward_outputs(res)
        return out.unflatten(0, (b, seq)).transpose(1, 2)[..., : v.shape[-1]], lse, (rng_state,)

    def backward_varlen(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        aux: KernelAux,
        cu_seqlens: Tensor,
        max_seqlen: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One ``_flash_attn_varlen_backward`` call: ``forward_varlen``'s lse and aux handed back."""
        (rng_state,) = aux
        b, _, seq, _ = q.shape
        dim = common_head_dim(q, v)
        qt, kt, vt, ot, dt = (_token_major(t) for t in self._padded(dim, q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        # fills dq, dk, dv in place (dk, dv keep the hkv heads: flash-attn sums the GQA groups)
        self._fa._flash_attn_varlen_backward(
            dt,
            qt,
            kt,
            vt,
            ot,
            lse,
            dq,
            dk,
            dv,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            0.0,
            self.scale_for(q.shape[-1]),
            self.causal,
            **self._window(),
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
            rng_state=rng_state,
        )
        dq, dk, dv = (g.unflatten(0, (b, seq)).transpose(1, 2) for g in (dq, dk, dv))
        return dq, dk, dv[..., : v.shape[-1]]
