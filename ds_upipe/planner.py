"""``ds-upipe plan``: an analytic per-GPU memory model for Ulysses (ALST) and UPipe training.

How it works.  A training step's memory is the model states (ZeRO-partitioned), a few fixed
working buffers, the activation checkpoints and the peak of one decoder layer's step.  That last
term is computed by replaying, tensor by tensor, what the code allocates and frees: ``Sim`` is a
tiny allocator that records the live bytes after every allocation (what MemTracker and the CUDA
caching allocator see), and the functions below mirror, step by step, the code they model:

- transformers' ``LlamaDecoderLayer``, ``LlamaRMSNorm`` (fp32 inside), ``apply_rotary_pos_emb``,
  ``LlamaMLP`` and ``sdpa_attention_forward`` (GQA handed to the kernel, no repeat_kv);
- DeepSpeed ALST's ``UlyssesSPAttentionHF`` (its contiguous copies and all-to-alls) and ``TiledMLP``;
- ``ds_upipe.pipeline`` / ``ds_upipe.comm`` (the stage loop, per-stage lse, fp32 dK/dV accumulation)
  and ``hf_patches`` (fused projections: x, the output and the lse saved; dx and the weight
  gradients accumulated in fp32 under 16-bit; o_proj inside the node) or its unfused path.

No constant is fitted to measurements: every size is a tensor the code creates.  The decoder-layer
replay is checked against MemTracker on CPU (``tests/test_planner.py``,
``benchmarks/validate_planner.py``, docs/benchmarks.md).  When the modelled code changes how it
allocates, the replay has to follow; the calibration test says when it no longer does.

A whole GPU run adds (all printed by ``ds-upipe plan`` and settable):
- mixed precision with Adam: 2 (weights) + 2 (grads) + 12 (fp32 master, m, v) bytes per parameter
  (fp32 training: 4 + 4 + 8), partitioned over the GPUs as the ZeRO stage says;
- ZeRO working buffers: the reduce bucket (DeepSpeed's default 5e8 elements) and, at stage 3, the
  gathered 16-bit weights in flight (the current module -- a layer, or the LM head at the loss --
  and the prefetched layer);
- checkpoints: with CPU offload only the layer being processed has its input on the GPU;
- the loss in sequence tiles (DeepSpeed's ``TiledFusedLogitsLoss``), or untiled full logits;
- the attention kernel's backward workspace on GPU ("fa2": torch SDPA / flash-attn 2, "fa3");
- a fixed reserve for the CUDA context, NCCL buffers and allocator fragmentation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .schedule import build_plan, valid_head_chunk_sizes

GiB = 2**30
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: the paper's sequence lengths (tokens); 1K = 1024
PAPER_STEPS = [128 * 2**10, 256 * 2**10, 512 * 2**10, 2**20, 2 * 2**20, 3 * 2**20, 4 * 2**20, 5 * 2**20]


# -- model dimensions --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    """What the memory model needs to know about a Llama-family decoder."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k
    attention_bias: bool = False  # Qwen2: q/k/v biases

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_param_counts(self) -> dict[str, int]:
        h, q, kv, i = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        counts = {
            "q_proj": h * q + (q if self.attention_bias else 0),
            "k_proj": h * kv + (kv if self.attention_bias else 0),
            "v_proj": h * kv + (kv if self.attention_bias else 0),
            "o_proj": q * h,
            "gate_proj": h * i,
            "up_proj": h * i,
            "down_proj": i * h,
            "norms": 2 * h + (2 * self.head_dim if self.qk_norm else 0),
        }
        return counts

    @property
    def params_per_layer(self) -> int:
        return sum(self.layer_param_counts().values())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        lm_head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + lm_head + self.num_layers * self.params_per_layer + self.hidden_size

    @staticmethod
    def from_config(config: dict, name: str = "config") -> ModelDims:
        """From a transformers config dict (config.json of a Llama/Mistral/Qwen2/Qwen3 model)."""
        cfg = config.get("text_config", config)
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers") if k not in cfg]
        if missing:
            raise ValueError(f"config lacks {missing}: not a Llama-family transformers config")
        heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type", "")
        return ModelDims(
            name=name,
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 4 * cfg["hidden_size"]),
            num_layers=cfg["num_hidden_layers"],
            vocab_size=cfg.get("vocab_size", 32000),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=model_type == "qwen3",
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        )

    @staticmethod
    def from_file(path: str | Path) -> ModelDims:
        return ModelDims.from_config(json.loads(Path(path).read_text()), name=str(path))


PRESETS = {
    "llama3-8b": ModelDims("llama3-8b", 32, 8, 128, 4096, 14336, 32, 128256),
    "qwen3-32b": ModelDims("qwen3-32b", 64, 8, 128, 5120, 25600, 64, 151936, qk_norm=True),
}


def model_dims(name_or_path: str) -> ModelDims:
    """A preset name (see PRESETS) or the path of a transformers config.json."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {name_or_path!r}: not a preset ({sorted(PRESETS)}) nor a config.json file")
    return ModelDims.from_file(path)


# -- the run being planned -----------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """``ulysses`` is DeepSpeed ALST's UlyssesSPAttentionHF; ``upipe`` is ours at head chunk U."""

    kind: str  # "ulysses" | "upipe"
    head_chunk_size: int | None = None
    fused: bool = True
    overlap_comm: bool = False  # the pipeline's prefetch of the next stage (two stages' inputs alive)

    @property
    def label(self) -> str:
        if self.kind == "ulysses":
            return "ulysses (ALST)"
        extra = ("" if self.fused else "-unfused") + ("+overlap" if self.overlap_comm else "")
        return f"upipe{extra} U={self.head_chunk_size}"


KERNELS = ("none", "fa2", "fa3")


@dataclass(frozen=True)
class TrainSetup:
    """One sequence-parallel training run (sequence-parallel degree = ``gpus``).

    Defaults are the paper's memory-efficient setting: ZeRO-3, full activation checkpointing with
    the checkpoints offloaded to CPU, tiled MLP and tiled loss, bf16, micro-batch 1."""

    gpus: int = 8
    gpu_memory_gib: float = 79.6  # an "80 GB" H100/A100 reports 81559 MiB
    zero_stage: int = 3
    checkpointing: bool = True
    offload_checkpoints: bool = True
    tiled_mlp: bool = True
    tiled_loss: bool = True
    fused_rmsnorm: bool = False  # Liger-style fused RMSNorm instead of transformers' eager fp32 upcast
    dtype: str = "bf16"
    batch: int = 1
    #: the attention kernel's backward workspace: "fa2" (torch SDPA's flash kernel, which both ALST's
    #: "sdpa" and ds_upipe's TorchSDPAKernel run on CUDA: fp32 dQ accumulator, GQA-expanded dK, dV),
    #: "fa3" (fp32 dQ, dK, dV accumulators), "none" (CPU / MemTracker: kernel-internal buffers unseen)
    kernel: str = "fa2"
    reserve_gib: float = 2.0  # CUDA context, NCCL buffers and allocator fragmentation
    zero_prefetch_layers: int = 1  # ZeRO-3: layers gathered ahead of the current one
    zero_reduce_bucket: int = 500_000_000  # ZeRO: reduce_bucket_size (elements), DeepSpeed's default

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"gpus={self.gpus} must be >= 1")
        if self.gpu_memory_gib <= 0:
            raise ValueError(f"gpu_memory_gib={self.gpu_memory_gib} must be positive")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.zero_stage}: must be 0, 1, 2 or 3")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(DTYPE_BYTES)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: choose one of {list(KERNELS)}")
        if self.batch < 1:
            raise ValueError(f"batch={self.batch} must be >= 1")
        if self.offload_checkpoints and not self.checkpointing:
            raise ValueError("offload_checkpoints=True needs checkpointing=True (only checkpoints are offloaded)")

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def methods_for(dims: ModelDims, gpus: int, fused: bool = True, overlap_comm: bool = False) -> list[Method]:
    """Ulysses, then UPipe at every valid U (smallest first)."""
    us = valid_head_chunk_sizes(dims.num_heads, dims.num_kv_heads, gpus)
    return [Method("ulysses")] + [Method("upipe", u, fused, overlap_comm) for u in us]


# -- the replaying allocator ---------------------------------------------------------------------


class Buf:
    __slots__ = ("name", "nbytes", "freed")

    def __init__(self, name: str, nbytes: int) -> None:
        self.name, self.nbytes, self.freed = name, int(nbytes), False


class Sim:
    """Live bytes after each allocation; the peak and what was being allocated when it happened.
    With ``trace``, also the allocation timeline and the buffers alive at the peak."""

    def __init__(self, resident: int = 0, trace: bool = False) -> None:
        self.live = resident
        self.peak = resident
        self.peak_at = "resident"
        self.trace: list[tuple[str, int]] | None = [] if trace else None
        self._alive: dict[int, Buf] | None = {} if trace else None
        self.at_peak: list[tuple[str, int]] = []

    def alloc(self, name: str, nbytes: float) -> Buf:
        buf = Buf(name, nbytes)
        self.live += buf.nbytes
        if self._alive is not None:
            self._alive[id(buf)] = buf
            self.trace.append((name, self.live))  # type: ignore[union-attr]
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, name
            if self._alive is not None:
                self.at_peak = [(b.name, b.nbytes) for b in self._alive.values() if b.nbytes]
        return buf

    def temp(self, name: str, nbytes: float) -> None:
        """An allocation freed right after it is made (e.g. an op output consumed by a reduction)."""
        self.free(self.alloc(name, nbytes))

    def free(self, *bufs: Buf | None) -> None:
        for buf in bufs:
            if buf is not None and not buf.freed:
                buf.freed = True
                self.live -= buf.nbytes
                if self._alive is not None:
                    self._alive.pop(id(buf), None)


# -- building blocks (each mirrors the code named in its docstring) --------------------------------


@dataclass
class Shapes:
    """Per-rank sizes of one decoder layer step."""

    dims: ModelDims
    seq: int  # global sequence length S
    gpus: int
    batch: int
    e: int  # activation bytes
    pe: int  # parameter (and parameter-gradient) bytes
    kernel: str  # the attention kernel's backward workspace: "none" | "fa2" | "fa3" (see TrainSetup)
    tiled_mlp: bool
    fused_rmsnorm: bool = False  # a fused (Liger-style) RMSNorm kernel instead of transformers' eager one

    @property
    def s(self) -> int:
        return self.seq // self.gpus

    @property
    def tokens(self) -> int:
        return self.batch * self.s

    @property
    def nh(self) -> int:
        return self.tokens * self.dims.hidden_size

    @property
    def nq(self) -> int:
        return self.tokens * self.dims.q_size

    @property
    def nkv(self) -> int:
        return self.tokens * self.dims.kv_size

    @property
    def ni(self) -> int:
        return self.tokens * self.dims.intermediate_size

    @property
    def acc(self) -> int:
        """Bytes of the fp32 accumulators the code uses for 16-bit tensors (fp64 stays fp64)."""
        return 8 if self.e == 8 else 4


def _rmsnorm(sim: Sim, x: Buf, n: int, e: int, grad: bool, tag: str, fused: bool = False) -> tuple[Buf, list[Buf]]:
    """LlamaRMSNorm.forward: h = x.to(fp32); h * rsqrt(h.pow(2).mean(-1) + eps); weight * h.to(dtype).

    Saves the fp32 input (x itself when x is fp32, a copy otherwise) and the normalized 16-bit
    tensor; the fp32 normalized tensor dies after the cast.  ``fused``: a fused kernel (Liger's
    LigerRMSNorm) that saves only x and the per-row rstd."""
    if fused:
        out = sim.alloc(f"{tag}.out", e * n)
        return out, ([x, Buf(f"{tag}.x_ref", 0)] if grad else [])
    xf = sim.alloc(f"{tag}.x_fp32", 4 * n) if e != 4 else x
    sim.temp(f"{tag}.pow", 4 * n)
    xn = sim.alloc(f"{tag}.normalized_fp32", 4 * n)
    if e != 4:
        xl = sim.alloc(f"{tag}.normalized", e * n)
        sim.free(xn)
    else:
        xl = xn
    out = sim.alloc(f"{tag}.out", e * n)
    if not grad:
        sim.free(xl, xf if xf is not x else None)
        return out, []
    return out, [xf, xl]


def _rmsnorm_backward(sim: Sim, saved: list[Buf], dout: Buf, n: int, e: int, tag: str, fused: bool = False) -> Buf:
    """Autograd through LlamaRMSNorm (fp32 inside).  Frees the saved tensors and ``dout``.
    ``fused``: one kernel writes dx (and per-SM partial weight gradients, negligible)."""
    if fused:
        dx = sim.alloc(f"{tag}.bwd.d_x", e * n)
        sim.free(dout, saved[0])
        return dx
    xf, xl = saved
    d_xl = sim.alloc(f"{tag}.bwd.d_normalized", e * n)  # dout * weight
    sim.temp(f"{tag}.bwd.d_weight_product", e * n)  # dout * normalized, summed into d_weight
    sim.free(xl, dout)
    if e != 4:
        d_xn = sim.alloc(f"{tag}.bwd.d_normalized_fp32", 4 * n)
        sim.free(d_xl)
    else:
        d_xn = d_xl
    g1 = sim.alloc(f"{tag}.bwd.d_x_direct", 4 * n)  # d_xn * rsqrt
    sim.temp(f"{tag}.bwd.d_rsqrt_product", 4 * n)  # d_xn * x, summed into d_rsqrt
    sim.free(d_xn)
    # mean backward (expand / n), then pow backward: x.pow(1), 2 * (.), grad * (.) alive together
    t = [sim.alloc(f"{tag}.bwd.pow_backward{i}", 4 * n) for i in range(4)]
    sim.free(*t[:3])
    g = sim.alloc(f"{tag}.bwd.d_x_fp32", 4 * n)  # the two paths summed
    sim.free(g1, t[3], xf)
    if e == 4:
        return g
    out = sim.alloc(f"{tag}.bwd.d_x", e * n)
    sim.free(g)
    return out


def _rope(sim: Sim, n: int, e: int, tag: str) -> Buf:
    """apply_rotary_pos_emb / hf_patches' RoPE on one tensor: x*cos + cat(-x2, x1)*sin (saves only
    cos, sin).  The input is the caller's."""
    t1 = sim.alloc(f"{tag}.x_cos", e * n)
    neg = sim.alloc(f"{tag}.neg_half", e * n // 2)
    rh = sim.alloc(f"{tag}.rotate_half", e * n)
    sim.free(neg)
    t2 = sim.alloc(f"{tag}.rot_sin", e * n)
    sim.free(rh)
    out = sim.alloc(f"{tag}.out", e * n)
    sim.free(t1, t2)
    return out


def _rope_backward(sim: Sim, dout: Buf, n: int, e: int, tag: str) -> Buf:
    """Autograd through the RoPE above: mul backward, neg, two slice_backward, sums.  Frees dout."""
    d_rot = sim.alloc(f"{tag}.bwd.d_rotate_half", e * n)
    neg = sim.alloc(f"{tag}.bwd.neg", e * n // 2)
    sb1 = sim.alloc(f"{tag}.bwd.slice_backward1", e * n)
    sim.free(neg)
    sb2 = sim.alloc(f"{tag}.bwd.slice_backward2", e * n)
    sim.free(d_rot, sb2)
    d_cos = sim.alloc(f"{tag}.bwd.d_x_cos", e * n)
    out = sim.alloc(f"{tag}.bwd.d_x", e * n)
    sim.free(d_cos, sb1, dout)
    return out


def _exchange(sim: Sim, nbytes: int, tag: str, copy_in: bool = True) -> Buf:
    """An all-to-all's contiguous send copy and receive buffer; returns the receive buffer."""
    send = sim.alloc(f"{tag}.send", nbytes) if copy_in else None
    recv = sim.alloc(f"{tag}.recv", nbytes)
    sim.free(send)
    return recv


def _finish(sim: Sim, recv: Buf, copy: bool, tag: str) -> Buf:
    """The post-exchange reshape: a copy unless the permuted layout is already contiguous."""
    if not copy:
        return recv
    out = sim.alloc(f"{tag}.rearranged", recv.nbytes)
    sim.free(recv)
    return out


def _kernel_workspace(sim: Sim, sh: Shapes, nq: int, nkv: int, gqa: bool, expand_inputs: bool = False) -> None:
    """Buffers a GPU flash-attention backward holds besides dq, dk, dv (freed on return).

    "fa2" (torch SDPA's flash kernel, flash-attn 2): dQ accumulated in fp32 and, under GQA, dK/dV
    written per query head before being summed; ``expand_inputs``: the caller also repeated K and V
    to the query heads (ds_upipe's TorchSDPAKernel on CUDA does).  "fa3": dQ, dK, dV accumulated in
    fp32, GQA native.  "none": CPU, where MemTracker does not see kernel-internal buffers."""
    bufs = []
    if sh.kernel == "fa3":
        bufs = [sim.alloc("flash.bwd.dq_accum", 4 * nq), sim.alloc("flash.bwd.dkv_accum", 8 * nkv)]
    elif sh.kernel == "fa2":
        if gqa and expand_inputs:
            bufs.append(sim.alloc("kernel.expanded_kv", 2 * sh.e * nq))
        bufs.append(sim.alloc("flash.bwd.dq_accum", 4 * nq))
        if gqa:
            bufs.append(sim.alloc("flash.bwd.dkv_expanded", 2 * sh.e * nq))
    sim.free(*bufs)


class _Params:
    """Weight gradients of the layer: made at each projection's backward and kept to the end of the
    layer's step (ZeRO reduces them after the layer; without ZeRO they are the .grad tensors)."""

    def __init__(self, sim: Sim, sh: Shapes) -> None:
        self.sim, self.sh = sim, sh
        self.grads: list[Buf] = []

    def grad(self, name: str) -> Buf:
        buf = self.sim.alloc(f"{name}.weight.grad", self.sh.pe * self.sh.dims.layer_param_counts()[name])
        self.grads.append(buf)
        return buf

    def release(self) -> None:
        self.sim.free(*self.grads)


# -- attention: each returns (o_proj output, backward(d_o) -> d(attention input)) ------------------


def _hf_qkv(sim: Sim, sh: Shapes, grad: bool) -> tuple[Buf, Buf, Buf, list[list[Buf]]]:
    """The HF attention module's own q/k/v: projections, Qwen3's q/k norm, RoPE (query/key/value_states)."""
    e = sh.e
    q = sim.alloc("q_proj.out", e * sh.nq)
    k = sim.alloc("k_proj.out", e * sh.nkv)
    v = sim.alloc("v_proj.out", e * sh.nkv)
    norms: list[list[Buf]] = []
    q_in, k_in = q, k
    if sh.dims.qk_norm:
        q_in, sq = _rmsnorm(sim, q, sh.nq, e, grad, "q_norm", sh.fused_rmsnorm)
        k_in, sk = _rmsnorm(sim, k, sh.nkv, e, grad, "k_norm", sh.fused_rmsnorm)
        norms = [sq, sk]
        sim.free(None if q in sq else q, None if k in sk else k)  # unless the norms saved them
    qr = _rope(sim, sh.nq, e, "rope_q")
    kr = _rope(sim, sh.nkv, e, "rope_k")
    sim.free(q_in, k_in)
    return qr, kr, v, norms


def _hf_qkv_backward(
    sim: Sim, sh: Shapes, params: _Params, dq: Buf, dk: Buf, dv: Buf, n1: Buf, norms: list[list[Buf]]
) -> Buf:
    """RoPE (+ q/k norm) backward, then v/k/q projections' backward; d(n1) summed out of place."""
    e = sh.e
    dk = _rope_backward(sim, dk, sh.nkv, e, "rope_k")
    dq = _rope_backward(sim, dq, sh.nq, e, "rope_q")
    if norms:
        dk = _rmsnorm_backward(sim, norms[1], dk, sh.nkv, e, "k_norm", sh.fused_rmsnorm)
        dq = _rmsnorm_backward(sim, norms[0], dq, sh.nq, e, "q_norm", sh.fused_rmsnorm)
    params.grad("v_proj")
    dn_v = sim.alloc("v_proj.bwd.d_input", e * sh.nh)
    sim.free(dv)
    params.grad("k_proj")
    dn_k = sim.alloc("k_proj.bwd.d_input", e * sh.nh)
    sim.free(dk)
    acc = sim.alloc("attention.d_input.sum", e * sh.nh)
    sim.free(dn_v, dn_k)
    params.grad("q_proj")
    dn_q = sim.alloc("q_proj.bwd.d_input", e * sh.nh)
    sim.free(dq, n1)
    total = sim.alloc("attention.d_input.sum", e * sh.nh)
    sim.free(acc, dn_q)
    return total


def _alst_attention(sim: Sim, sh: Shapes, n1: Buf, grad: bool, params: _Params):
    """HF LlamaAttention with DeepSpeed ALST's UlyssesSPAttentionHF around transformers'
    sdpa_attention_forward (GQA handed to the kernel), then o_proj."""
    e, dims, b = sh.e, sh.dims, sh.batch
    q, k, v, norms = _hf_qkv(sim, sh, grad)
    heads_local = dims.num_heads // sh.gpus
    kv_local = max(dims.num_kv_heads // sh.gpus, 1)
    rep = max(1, sh.gpus // dims.num_kv_heads)  # repeat_interleave of KV heads when Hkv < C
    n_kv_gathered = b * sh.seq * kv_local * dims.head_dim
    # _combine_local_sequences: reshape(...) of the permuted view copies, all-to-all, then
    # rearrange(...).contiguous() (a copy unless the layout is already [b, h, S, d])
    qg = _finish(sim, _exchange(sim, e * sh.nq, "alst.q"), b > 1 or heads_local > 1, "alst.q")
    kg = _finish(sim, _exchange(sim, e * sh.nkv * rep, "alst.k"), b > 1 or kv_local > 1, "alst.k")
    vg = _finish(sim, _exchange(sim, e * sh.nkv * rep, "alst.v"), b > 1 or kv_local > 1, "alst.v")
    og = sim.alloc("sdpa.out", e * sh.nq)
    lse = sim.alloc("sdpa.lse", 4 * b * heads_local * sh.seq)
    ctx = sim.alloc("sdpa.out.transpose_contiguous", e * sh.nq)
    # _partition_global_sequence: all-to-all, rearrange + reshape(...).contiguous()
    local = _finish(sim, _exchange(sim, e * sh.nq, "alst.out", copy_in=b > 1), True, "alst.out")
    sim.free(ctx)
    saved = [qg, kg, vg, og, lse]
    if not grad:
        sim.free(*saved)
    sim.free(q, k, v)  # query/key/value_states die with the module's forward
    o = sim.alloc("o_proj.out", e * sh.nh)
    if not grad:
        sim.free(local)

    def backward(d_o: Buf) -> Buf:
        params.grad("o_proj")
        d_local = sim.alloc("o_proj.bwd.d_input", e * sh.nq)
        sim.free(local)
        d_ctx = _finish(sim, _exchange(sim, e * sh.nq, "alst.out.bwd"), b > 1 or heads_local > 1, "alst.out.bwd")
        sim.free(d_local)
        dq = sim.alloc("sdpa.bwd.dq", e * sh.nq)
        dk = sim.alloc("sdpa.bwd.dk", e * n_kv_gathered)
        dv = sim.alloc("sdpa.bwd.dv", e * n_kv_gathered)
        _kernel_workspace(sim, sh, sh.nq, n_kv_gathered, heads_local > kv_local)
        sim.free(d_ctx, *saved)
        grads = []
        for name, buf, n in (("k", dk, sh.nkv * rep), ("v", dv, sh.nkv * rep), ("q", dq, sh.nq)):
            loc = _finish(sim, _exchange(sim, e * n, f"alst.{name}.bwd", copy_in=False), name == "q", f"alst.{name}")
            sim.free(buf)
            if rep > 1 and name != "q":  # repeat_interleave backward sums the replicas
                summed = sim.alloc(f"alst.{name}.bwd.unreplicate", e * sh.nkv)
                sim.free(loc)
                loc = summed
            grads.append(loc)
        dk_l, dv_l, dq_l = grads
        return _hf_qkv_backward(sim, sh, params, dq_l, dk_l, dv_l, n1, norms)

    return o, backward


class _FusedSource:
    """hf_patches.fused.FusedProjectionSource: a stage's heads projected from x with the heads'
    weight rows (index_select), Qwen3's q/k norm and RoPE applied to the chunk.  Backward keeps
    only the head rows per stage in flight (and the pre-norm chunk under a q/k norm), takes the
    gradient back through RoPE by hand and accumulates dx (fp32 under 16-bit) and the weight
    gradients (fp32 under 16-bit) in place."""

    def __init__(self, sim: Sim, sh: Shapes, backward: bool) -> None:
        self.sim, self.sh, self.backward = sim, sh, backward
        self.gx: Buf | None = None
        self.wacc: dict[str, Buf] = {}

    def _linear(self, n: int, rows: int, tag: str) -> Buf:
        """F.linear(x, W.index_select(0, rows)): the selected rows die with the expression."""
        w = self.sim.alloc(f"fused.{tag}.weight_rows", self.sh.pe * rows * self.sh.dims.hidden_size)
        y = self.sim.alloc(f"fused.{tag}.rows_out", self.sh.e * n)
        self.sim.free(w)
        return y

    def _chunk(self, n: int, rows: int, tag: str) -> tuple[Buf, list[Buf]]:
        sim, sh = self.sim, self.sh
        y = self._linear(n, rows, tag)
        pending: list[Buf] = []
        if sh.dims.qk_norm:
            yn, saved = _rmsnorm(sim, y, n, sh.e, False, f"fused.{tag}_norm", sh.fused_rmsnorm)
            if self.backward:
                pending = [y]  # the pre-norm chunk, for the norm's backward
            else:
                sim.free(y)
            y = yn
        out = sim.alloc(f"fused.{tag}.rope", sh.e * n)  # apply_rope: y * cos, then two addcmul_ in place
        sim.free(y)
        return out, pending

    def query(self, n: int, rows: int) -> tuple[Buf, list[Buf]]:
        return self._chunk(n, rows, "q")

    def key_value(self, n: int, rows: int) -> tuple[Buf, Buf, list[Buf]]:
        k, pending = self._chunk(n, rows, "k")
        return k, self._linear(n, rows, "v"), pending

    def grad_chunk(self, grad: Buf, n: int, rows: int, pending: list[Buf], name: str, rope: bool = True) -> None:
        """_chunk_backward (grad*cos - rotate_half(grad*sin); norm by autograd) and _linear_backward:
        dx.addmm_(g, W[rows]) in place, dW[rows] += g^T x."""
        sim, sh = self.sim, self.sh
        e, h = sh.e, sh.dims.hidden_size
        g = grad
        if rope:
            g = sim.alloc(f"fused.{name}.rope_backward", e * n)  # grad * cos, then two addcmul_ in place
            if pending and name != "v":  # the q/k norm's backward by autograd on the pre-norm chunk
                out, saved = _rmsnorm(sim, pending[0], n, e, True, f"fused.{name}_norm", sh.fused_rmsnorm)
                sim.free(out)
                g2 = _rmsnorm_backward(sim, saved, g, n, e, f"fused.{name}_norm", sh.fused_rmsnorm)
                g = g2
        if self.gx is None:
            self.gx = sim.alloc("fused.grad_x", (sh.acc if e != 4 else e) * sh.nh)
        w = sim.alloc(f"fused.{name}.weight_rows", sh.pe * rows * h)
        if e == 2:  # g.to(fp32) and W[rows].to(fp32) for the fp32 addmm_
            casts = [sim.alloc("fused.grad_x.addmm_cast", 4 * n), sim.alloc("fused.weight_rows_fp32", 4 * rows * h)]
            sim.free(*casts)
        dw = sim.alloc(f"fused.{name}.weight_rows_grad", e * rows * h)  # g.t() @ x2d
        proj = {"q": "q_proj", "k": "k_proj", "v": "v_proj"}[name]
        if proj not in self.wacc:
            acc = 4 if sh.pe == 2 else sh.pe
            self.wacc[proj] = sim.alloc(f"fused.{proj}.grad_acc", acc * sh.dims.layer_param_counts()[proj])
        if sh.pe == 2:
            sim.temp("fused.weight_grad.index_add_cast", 4 * rows * h)
        sim.free(dw, w, g, grad)  # W[rows] is a local of _linear_backward
        if name != "k":
            sim.free(*pending)


class _LocalSource:
    """ds_upipe.pipeline.LocalTensorSource: stage heads index_select-ed from the saved local q, k, v;
    gradients index_add-ed into zero-initialized q/k/v-shaped buffers."""

    def __init__(self, sim: Sim, sh: Shapes) -> None:
        self.sim, self.sh = sim, sh
        self.gq: Buf | None = None
        self.gk: Buf | None = None
        self.gv: Buf | None = None

    def query(self, n: int, rows: int) -> tuple[Buf, list[Buf]]:
        return self.sim.alloc("upipe.q.select", self.sh.e * n), []

    def key_value(self, n: int, rows: int) -> tuple[Buf, Buf, list[Buf]]:
        return self.sim.alloc("upipe.k.select", self.sh.e * n), self.sim.alloc("upipe.v.select", self.sh.e * n), []

    def grad_chunk(self, grad: Buf, n: int, rows: int, pending: list[Buf], name: str, rope: bool = True) -> None:
        sh = self.sh
        attr = {"q": "gq", "k": "gk", "v": "gv"}[name]
        if getattr(self, attr) is None:
            size = sh.nq if name == "q" else sh.nkv
            setattr(self, attr, self.sim.alloc(f"upipe.grad_{name}", sh.e * size))
        self.sim.free(grad)


def _gather(sim: Sim, local: Buf, nbytes: int, copy: bool, tag: str) -> Buf:
    """PipelineContext.gather: the send copy (``local`` is freed once it exists), the receive buffer
    (the send copy goes when the synchronous exchange returns), then the reshape into [b, n, S, d]
    (a copy unless already contiguous)."""
    _, recv = _start(sim, local, nbytes, tag, async_op=False)
    return _finish(sim, recv, copy, tag)


def _start(sim: Sim, local: Buf, nbytes: int, tag: str, async_op: bool) -> tuple[Buf | None, Buf]:
    """PipelineContext.start_gather: (send, recv); ``local`` is freed once its send copy exists, and a
    synchronous exchange has already dropped its send."""
    send = sim.alloc(f"{tag}.send", nbytes)
    sim.free(local)
    recv = sim.alloc(f"{tag}.recv", nbytes)
    if async_op:
        return send, recv
    sim.free(send)
    return None, recv


def _wait(sim: Sim, ex: list[tuple[Buf | None, Buf]], copy: bool, tag: str) -> list[Buf]:
    """PendingExchange.wait for each exchange: the gathered buffers.  The reshape into [b, n, S, d]
    (a copy unless contiguous), then the handle drops its send and receive buffers and the work
    object that referenced them."""
    held = []
    for send, recv in ex:
        held.append(_finish(sim, recv, copy, tag))
        sim.free(send)
    return held


def _scatter(sim: Sim, full: Buf, nbytes: int, send_copy: bool, tag: str) -> Buf:
    """PipelineContext.scatter_by_rank: the send-layout copy of ``full`` when its layout (or dtype)
    needs one, with ``full`` freed once it exists; the receive buffer, [C, b, s, n, d], which the
    caller hands over per source rank (no final rearrangement)."""
    send = full
    if send_copy:
        send = sim.alloc(f"{tag}.send", nbytes)
        sim.free(full)
    recv = sim.alloc(f"{tag}.recv", nbytes)
    sim.free(send)
    return recv


def _prefetched(sim: Sim, n: int, start, copy: bool, tag: str, overlap: bool):
    """PipelineContext.prefetched: per stage, (its gathered buffers, what ``start`` returned besides
    the exchanges).  With overlap the next stage is started before the current one is handed out."""
    pending = start() if n else None
    for i in range(n):
        ex, extra = pending
        held = _wait(sim, ex, copy, tag)
        has_next = i + 1 < n
        pending = start() if overlap and has_next else None
        yield held, extra
        if not overlap and has_next:
            pending = start()


def _upipe_attention(sim: Sim, sh: Shapes, method: Method, n1: Buf, grad: bool, params: _Params):
    """ds_upipe.pipeline's stage loop inside hf_patches' FusedUPipeAttention (fused; o_proj inside
    the node) or inside UPipeAttentionFunction behind transformers' attention registry (unfused).

    Saved for backward: the node's inputs (x, or the local q, k, v), the output and the per-stage
    lse -- nothing gathered.  A stage's gathered inputs are freed as soon as its kernel is done."""
    e, dims, b = sh.e, sh.dims, sh.batch
    plan = build_plan(dims.num_heads, dims.num_kv_heads, sh.gpus, method.head_chunk_size or sh.gpus)
    u, kvpr, d = plan.heads_per_rank, plan.kv_heads_per_rank, dims.head_dim
    nq_st, nkv_rd = b * u * sh.seq * d, b * kvpr * sh.seq * d  # gathered sizes (= local chunk sizes)
    rows_q, rows_kv = u * sh.gpus * d, kvpr * sh.gpus * d  # weight rows of a stage's chunk
    lse_st = 4 * b * u * sh.seq
    copy_q, copy_kv = b * u > 1, b * kvpr > 1
    if not method.fused:
        q, k, v, norms = _hf_qkv(sim, sh, grad)
    out = sim.alloc("upipe.out", e * sh.nq)
    lses: list[Buf] = []
    src_f: _FusedSource | _LocalSource = _FusedSource(sim, sh, False) if method.fused else _LocalSource(sim, sh)
    for rnd in plan.rounds:
        kc, vc, _ = src_f.key_value(nkv_rd, rows_kv)
        kf = _gather(sim, kc, e * nkv_rd, copy_kv, "upipe.k")
        vf = _gather(sim, vc, e * nkv_rd, copy_kv, "upipe.v")

        def start_fwd() -> tuple[list[tuple[Buf | None, Buf]], None]:
            qc, _ = src_f.query(nq_st, rows_q)
            return [_start(sim, qc, e * nq_st, "upipe.q", method.overlap_comm)], None

        for (qf,), _ in _prefetched(sim, len(rnd.stages), start_fwd, copy_q, "upipe.q", method.overlap_comm):
            of = sim.alloc("kernel.out", e * nq_st)
            lses.append(sim.alloc("kernel.lse", lse_st))
            sim.free(qf)
            # written into the output per source rank (index_copy_), no rearranged copy
            sim.free(_scatter(sim, of, e * nq_st, copy_q, "upipe.out"))
        sim.free(kf, vf)
    if not grad:
        sim.free(*lses)
        if not method.fused:
            sim.free(q, k, v)
    o = sim.alloc("o_proj.out", e * sh.nh)
    if not grad:
        sim.free(out)

    def backward(d_o: Buf) -> Buf:
        if method.fused:
            d_out = None  # FusedUPipeAttention: each stage's dout = dy @ Wo[:, the stage's columns]
            src: _FusedSource | _LocalSource = _FusedSource(sim, sh, True)
        else:
            params.grad("o_proj")
            d_out = sim.alloc("o_proj.bwd.d_input", e * sh.nq)
            src = _LocalSource(sim, sh)
        # RoundKeyValueGrads: LocalTensorSource takes partial gradients, per source rank (no rearranged
        # copy), and with gradients in the accumulation dtype each stage's dK/dV goes back at once
        by_rank = not method.fused
        per_stage = by_rank and sh.acc == e
        for rnd in plan.rounds:
            kc, vc, kv_pending = src.key_value(nkv_rd, rows_kv)
            kf = _gather(sim, kc, e * nkv_rd, copy_kv, "upipe.bwd.k")
            vf = _gather(sim, vc, e * nkv_rd, copy_kv, "upipe.bwd.v")
            if not per_stage:  # allocated in the send layout
                gka = sim.alloc("upipe.bwd.dk_acc", sh.acc * nkv_rd)
                gva = sim.alloc("upipe.bwd.dv_acc", sh.acc * nkv_rd)

            def send_kv(dk: Buf, dv: Buf, send_copy: bool, kv_pending: list[Buf]) -> None:
                """RoundKeyValueGrads._send: dK then dV all-to-all'd, then handed to the source."""
                locs = [_scatter(sim, g, e * nkv_rd, send_copy, f"upipe.bwd.d{n}") for g, n in ((dk, "k"), (dv, "v"))]
                if not by_rank and copy_kv:  # comm.from_ranks: one [b, s, C*n, d] copy each
                    rearranged = [sim.alloc(f"upipe.bwd.d{n}.rearranged", e * nkv_rd) for n in "kv"]
                    sim.free(*locs)
                    locs = rearranged
                src.grad_chunk(locs[0], nkv_rd, rows_kv, kv_pending, "k")
                src.grad_chunk(locs[1], nkv_rd, rows_kv, kv_pending, "v", rope=False)

            def start_bwd() -> tuple[list[tuple[Buf | None, Buf]], list[Buf]]:
                # start_stage: q, then this stage's dout, then its output, each exchange started at
                # once; a synchronous one drops its send copy on return, an async one owns it
                qc, q_pending = src.query(nq_st, rows_q)
                ex = [_start(sim, qc, e * nq_st, "upipe.bwd.q", method.overlap_comm)]
                if method.fused:
                    cols = sim.alloc("fused.o_proj.weight_columns", sh.pe * dims.hidden_size * rows_q)
                    dsel = sim.alloc("fused.dout_chunk", e * nq_st)
                    sim.free(cols)
                else:
                    dsel = sim.alloc("upipe.bwd.dout.select", e * nq_st)
                ex.append(_start(sim, dsel, e * nq_st, "upipe.bwd.dout", method.overlap_comm))
                osel = sim.alloc("upipe.bwd.out.select", e * nq_st)
                ex.append(_start(sim, osel, e * nq_st, "upipe.bwd.out", method.overlap_comm))
                return ex, q_pending

            stages = _prefetched(sim, len(rnd.stages), start_bwd, copy_q, "upipe.bwd.gathered", method.overlap_comm)
            for held, q_pending in stages:
                dq = sim.alloc("kernel.bwd.dq", e * nq_st)
                dk = sim.alloc("kernel.bwd.dk", e * nkv_rd)
                dv = sim.alloc("kernel.bwd.dv", e * nkv_rd)
                _kernel_workspace(sim, sh, nq_st, nkv_rd, u > kvpr, expand_inputs=True)
                sim.free(*held)
                # the kernel's dq is [b, n, S, d]: its send layout is a copy unless b = n = 1
                dq_loc = _scatter(sim, dq, e * nq_st, copy_q, "upipe.bwd.dq")
                if not by_rank and copy_q:  # comm.from_ranks
                    rearranged = sim.alloc("upipe.bwd.dq.rearranged", e * nq_st)
                    sim.free(dq_loc)
                    dq_loc = rearranged
                src.grad_chunk(dq_loc, nq_st, rows_q, q_pending, "q")
                if per_stage:
                    send_kv(dk, dv, copy_kv, kv_pending)
                else:
                    sim.free(dk, dv)  # summed into the accumulators in place
            sim.free(kf, vf)
            if not per_stage:  # the accumulators are sent as they are, cast to 16 bits first if need be
                send_kv(gka, gva, sh.acc != e, kv_pending)
        if method.fused:
            assert isinstance(src, _FusedSource)
            if e == 2:  # FusedProjectionSource.results(): casts to the input/param dtypes
                dx = sim.alloc("fused.grad_x.cast", e * sh.nh)
                casts = [sim.alloc("fused.weight_grad.cast", w.nbytes // 2) for w in src.wacc.values()]
                sim.free(src.gx, *src.wacc.values())
                params.grads.extend(casts)
            else:
                dx = src.gx
                params.grads.extend(src.wacc.values())
            params.grad("o_proj")  # dy^T @ out
            sim.free(*lses, out, n1)
            return dx
        assert isinstance(src, _LocalSource)
        sim.free(*lses, out, d_out, q, k, v)
        return _hf_qkv_backward(sim, sh, params, src.gq, src.gk, src.gv, n1, norms)

    return o, backward


# -- MLP ---------------------------------------------------------------------------------------------


def _mlp(sim: Sim, sh: Shapes, x: Buf, grad: bool, params: _Params):
    """LlamaMLP, down(act(gate(x)) * up(x)), or DeepSpeed's TiledMLP over ceil(s / hidden) shards
    (forward under no_grad per shard; backward recomputes each shard with grad)."""
    e, nh, ni = sh.e, sh.nh, sh.ni
    if sh.tiled_mlp:
        shards = max(1, math.ceil(sh.s / sh.dims.hidden_size))
        ni_s, nh_s = math.ceil(ni / shards), math.ceil(nh / shards)
        outs = []
        for i in range(min(shards, 2)):  # shards after the second repeat the second's pattern
            g = sim.alloc("tiled_mlp.gate", e * ni_s)
            a = sim.alloc("tiled_mlp.act", e * ni_s)
            sim.free(g)
            up = sim.alloc("tiled_mlp.up", e * ni_s)
            m = sim.alloc("tiled_mlp.mul", e * ni_s)
            sim.free(a, up)
            outs.append(sim.alloc("tiled_mlp.out_shard", e * nh_s * (1 if i == 0 else shards - 1)))
            sim.free(m)
        y = sim.alloc("tiled_mlp.out", e * nh)  # torch.cat of the shard outputs
        sim.free(*outs)

        def tiled_backward(dy: Buf) -> Buf:
            dx = sim.alloc("tiled_mlp.bwd.x_grad", e * nh)  # zeros_like(x); shards' grads land in it
            prev_out = None
            for i in range(min(shards, 2)):
                g = sim.alloc("tiled_mlp.bwd.gate", e * ni_s)
                a = sim.alloc("tiled_mlp.bwd.act", e * ni_s)
                up = sim.alloc("tiled_mlp.bwd.up", e * ni_s)
                m = sim.alloc("tiled_mlp.bwd.mul", e * ni_s)
                o = sim.alloc("tiled_mlp.bwd.out", e * nh_s)
                sim.free(prev_out)
                prev_out = o  # the loop variable keeps the previous shard's output
                dm = sim.alloc("tiled_mlp.bwd.d_mul", e * ni_s)
                wd = params.grad("down_proj") if i == 0 else sim.alloc("down_proj.grad.shard", 0)
                if i:
                    sim.temp("down_proj.weight.grad.shard", sh.pe * sh.dims.layer_param_counts()["down_proj"])
                sim.free(m)
                da = sim.alloc("tiled_mlp.bwd.d_act", e * ni_s)
                du = sim.alloc("tiled_mlp.bwd.d_up", e * ni_s)
                sim.free(dm, a, up)
                if i == 0:
                    params.grad("up_proj")
                else:
                    sim.temp("up_proj.weight.grad.shard", sh.pe * sh.dims.layer_param_counts()["up_proj"])
                dxu = sim.alloc("tiled_mlp.bwd.dx_up", e * nh_s)
                sim.free(du)
                dg = sim.alloc("tiled_mlp.bwd.d_gate", e * ni_s)
                sim.free(da, g)
                if i == 0:
                    params.grad("gate_proj")
                else:
                    sim.temp("gate_proj.weight.grad.shard", sh.pe * sh.dims.layer_param_counts()["gate_proj"])
                dxg = sim.alloc("tiled_mlp.bwd.dx_gate", e * nh_s)
                sim.free(dg)
                dxs = sim.alloc("tiled_mlp.bwd.dx_shard", e * nh_s)
                sim.free(dxu, dxg, dxs, wd if i else None)
            sim.free(prev_out, x, dy)
            return dx

        return y, tiled_backward

    g = sim.alloc("gate_proj.out", e * ni)
    a = sim.alloc("act.out", e * ni)
    up = sim.alloc("up_proj.out", e * ni)
    m = sim.alloc("mul.out", e * ni)
    y = sim.alloc("down_proj.out", e * nh)
    if not grad:
        sim.free(g, a, up, m)

    def backward(dy: Buf) -> Buf:
        params.grad("down_proj")
        dm = sim.alloc("down_proj.bwd.d_input", e * ni)
        sim.free(m)
        da = sim.alloc("mul.bwd.d_act", e * ni)
        du = sim.alloc("mul.bwd.d_up", e * ni)
        sim.free(dm, a, up)
        params.grad("up_proj")
        dx_u = sim.alloc("up_proj.bwd.d_input", e * nh)
        sim.free(du)
        dg = sim.alloc("act.bwd.d_gate", e * ni)
        sim.free(da, g)
        params.grad("gate_proj")
        dx_g = sim.alloc("gate_proj.bwd.d_input", e * nh)
        sim.free(dg)
        dx = sim.alloc("mlp.d_input.sum", e * nh)
        sim.free(dx_u, dx_g, x, dy)
        return dx

    return y, backward


# -- the decoder layer ----------------------------------------------------------------------------


def layer_step(sim: Sim, sh: Shapes, method: Method, grad: bool = True) -> None:
    """One LlamaDecoderLayer forward (saving for backward when ``grad``) and, when ``grad``, its
    backward.  The layer input x and the incoming dy belong to the caller (counted as resident);
    the layer output stays alive to the end (it is the next layer's input)."""
    e, nh = sh.e, sh.nh
    params = _Params(sim, sh)
    x = Buf("x", 0)
    n1, norm1_saved = _rmsnorm(sim, x, nh, e, grad, "input_layernorm", sh.fused_rmsnorm)
    if method.kind == "ulysses":
        o, attn_backward = _alst_attention(sim, sh, n1, grad, params)
    else:
        o, attn_backward = _upipe_attention(sim, sh, method, n1, grad, params)
    if not grad:
        sim.free(n1)
    h1 = sim.alloc("residual1.out", e * nh)
    sim.free(o)
    n2, norm2_saved = _rmsnorm(sim, h1, nh, e, grad, "post_attention_layernorm", sh.fused_rmsnorm)
    y_mlp, mlp_backward = _mlp(sim, sh, n2, grad, params)
    if not grad:
        sim.free(n2)
    y = sim.alloc("residual2.out", e * nh)
    sim.free(y_mlp)
    if not grad or h1 not in norm2_saved:
        sim.free(h1)  # transformers' norm in 16-bit saved an fp32 copy, not h1 itself
    if not grad:
        sim.free(y)
        return
    # ---- backward, in autograd's order: MLP, norm2, attention, norm1 ----
    dy = Buf("dy", 0)  # the caller's
    dn2 = mlp_backward(dy)
    dh1_n = _rmsnorm_backward(sim, norm2_saved, dn2, nh, e, "post_attention_layernorm", sh.fused_rmsnorm)
    dh1 = sim.alloc("residual1.d_sum", e * nh)  # dy + d(norm2): out of place, dy is referenced
    sim.free(dh1_n)
    dn1 = attn_backward(dh1)
    dx_n = _rmsnorm_backward(sim, norm1_saved, dn1, nh, e, "input_layernorm", sh.fused_rmsnorm)
    dx = sim.alloc("residual0.d_sum", e * nh)
    sim.free(dx_n, dh1, dx, y)
    params.release()


def layer_saved_bytes(sh: Shapes, method: Method) -> int:
    """Bytes one layer keeps for its backward (live after a grad forward, output included)."""
    probe = _ForwardProbe()
    try:
        layer_step(probe, sh, method, grad=True)
    except _StopAtBackward:
        pass
    return probe.after_forward


class _StopAtBackward(Exception):
    pass


class _ForwardProbe(Sim):
    """A Sim that stops at the first backward allocation, remembering the live bytes then."""

    def __init__(self) -> None:
        super().__init__(0)
        self.after_forward = 0

    def alloc(self, name: str, nbytes: float) -> Buf:
        if ".bwd." in name or name.endswith(".grad") or name.startswith(("fused.grad", "tiled_mlp.bwd")):
            self.after_forward = self.live
            raise _StopAtBackward
        return super().alloc(name, nbytes)


# -- a decoder layer alone (what the CPU validation measures) ---------------------------------------


def layer_peak_bytes(
    dims: ModelDims,
    method: Method,
    seq: int,
    gpus: int,
    dtype: str = "fp32",
    batch: int = 1,
    tiled_mlp: bool = False,
    kernel: str = "none",
) -> tuple[int, str]:
    """Peak bytes of one rank over one decoder layer's forward+backward without checkpointing,
    counting the layer's weights, its input x, the incoming dy, cos/sin and the position ids, and
    the weight gradients: what ``ds-upipe bench`` measures at the layer level.  (bytes, where)."""
    e = DTYPE_BYTES[dtype]
    sh = Shapes(dims, seq, gpus, batch, e, e, kernel, tiled_mlp)
    tokens = batch * sh.s
    resident = e * dims.params_per_layer + 2 * e * sh.nh + 2 * e * tokens * dims.head_dim + 8 * tokens
    sim = Sim(resident)
    layer_step(sim, sh, method, grad=True)
    return sim.peak, sim.peak_at


# -- a whole training step on one GPU ------------------------------------------------------------


@dataclass
class Prediction:
    """Predicted peak of one GPU for one training step (GiB), and its parts."""

    method: str
    seq_len: int
    total_gib: float
    fits: bool
    model_states_gib: float
    zero_buffers_gib: float
    activations_gib: float  # the largest phase: checkpoints on the GPU + that phase's working peak
    peak_phase: str  # phase: the allocation that set the peak
    reserve_gib: float
    phases_gib: dict[str, float] = field(default_factory=dict)


def model_state_bytes(dims: ModelDims, setup: TrainSetup) -> int:
    """Weights, gradients and Adam states on one GPU after ZeRO partitioning over the GPUs:
    bf16 2 + 2 + 12 (fp32 master, m, v) bytes per parameter; fp32 4 + 4 + 8."""
    p = dims.total_params
    w, g, o = (4, 4, 8) if setup.dtype == "fp32" else (2, 2, 12)
    n = setup.gpus
    if setup.zero_stage >= 3:
        return math.ceil(p * (w + g + o) / n)
    if setup.zero_stage == 2:
        return p * w + math.ceil(p * (g + o) / n)
    if setup.zero_stage == 1:
        return p * (w + g) + math.ceil(p * o / n)
    return p * (w + g + o)


def zero_buffer_bytes(dims: ModelDims, setup: TrainSetup) -> int:
    """ZeRO working buffers: the reduce bucket (stages 2-3) and, at stage 3, the gathered 16-bit
    weights in flight -- the current module (a layer, or the LM head at the loss) and the
    prefetched layers."""
    pe = DTYPE_BYTES[setup.dtype]
    bucket = pe * min(setup.zero_reduce_bucket, dims.total_params) if setup.zero_stage >= 2 else 0
    if setup.zero_stage < 3:
        return bucket
    current = max(dims.params_per_layer, dims.embedding_params)
    return bucket + pe * (current + setup.zero_prefetch_layers * dims.params_per_layer)


def _loss_step(sim: Sim, dims: ModelDims, sh: Shapes, tiled: bool) -> None:
    """Final norm, LM head and cross entropy on this rank's s tokens (forward + backward).

    Tiled (DeepSpeed's TiledFusedLogitsLoss): ceil(s*vocab / (s*hidden)) tiles, one tile's logits
    (16-bit, an fp32 upcast, its gradient) at a time.  Untiled: HF's full logits, their fp32 upcast
    and the softmax gradient."""
    e, nh = sh.e, sh.nh
    n_logits = sh.tokens * dims.vocab_size
    xn, saved = _rmsnorm(sim, Buf("h", 0), nh, e, True, "norm", sh.fused_rmsnorm)
    if tiled:
        tile = math.ceil(n_logits / max(1, math.ceil(n_logits / nh)))
        gx = sim.alloc("loss.x_grad", e * nh)
        bufs = [
            sim.alloc(n, b)
            for n, b in (("loss.tile", e * tile), ("loss.tile_fp32", 4 * tile), ("loss.dtile", 4 * tile))
        ]
        sim.free(*bufs)
    else:
        lg = sim.alloc("lm_head.logits", e * n_logits)
        lf = sim.alloc("loss.logits_fp32", 4 * n_logits)
        dl = sim.alloc("loss.dlogits_fp32", 4 * n_logits)
        sim.free(lf)
        dlo = sim.alloc("loss.dlogits", e * n_logits)
        sim.free(dl, lg)
        gx = sim.alloc("lm_head.bwd.d_input", e * nh)
        sim.free(dlo)
    dx = _rmsnorm_backward(sim, saved, gx, nh, e, "norm", sh.fused_rmsnorm)
    sim.free(dx, xn)


def predict(dims: ModelDims, setup: TrainSetup, method: Method, seq_len: int) -> Prediction:
    """Peak memory of one GPU for one training step at ``seq_len`` tokens (the whole sequence,
    split over ``setup.gpus`` sequence-parallel ranks)."""
    if seq_len < setup.gpus or seq_len % setup.gpus:
        raise ValueError(f"seq_len={seq_len} is not a positive multiple of gpus={setup.gpus}")
    e = setup.act_bytes
    sh = Shapes(dims, seq_len, setup.gpus, setup.batch, e, e, setup.kernel, setup.tiled_mlp, setup.fused_rmsnorm)
    x = e * sh.nh  # one hidden state of this rank: a layer input, its gradient, a checkpoint
    layers = dims.num_layers
    phases: dict[str, tuple[int, str]] = {}
    if setup.checkpointing:
        # checkpoints of all layers on the GPU unless offloaded (then only the one in transit)
        kept = x if setup.offload_checkpoints else layers * x
        sim = Sim(kept + x)  # + the current layer's input
        layer_step(sim, sh, method, grad=False)
        phases["forward"] = (sim.peak, sim.peak_at)
        # the layer being recomputed: its checkpoint back on the GPU, and dy from the layer above
        sim = Sim((x if setup.offload_checkpoints else layers * x) + x)
        layer_step(sim, sh, method, grad=True)
        phases["backward"] = (sim.peak, sim.peak_at)
        loss_resident = kept
    else:
        saved = layer_saved_bytes(sh, method)
        sim = Sim((layers - 1) * saved + 2 * x)  # every layer's saved tensors, the input and dy
        layer_step(sim, sh, method, grad=True)
        phases["backward"] = (sim.peak, sim.peak_at)
        loss_resident = layers * saved
    sim = Sim(loss_resident + x)
    _loss_step(sim, dims, sh, setup.tiled_loss)
    phases["loss"] = (sim.peak, sim.peak_at)
    phase = max(phases, key=lambda k: phases[k][0])
    act, where = phases[phase]
    states, zero, reserve = model_state_bytes(dims, setup), zero_buffer_bytes(dims, setup), setup.reserve_gib * GiB
    total = states + zero + act + reserve
    return Prediction(
        method=method.label,
        seq_len=seq_len,
        total_gib=total / GiB,
        fits=total <= setup.gpu_memory_gib * GiB,
        model_states_gib=states / GiB,
        zero_buffers_gib=zero / GiB,
        activations_gib=act / GiB,
        peak_phase=f"{phase}: {where}",
        reserve_gib=setup.reserve_gib,
        phases_gib={k: v[0] / GiB for k, v in phases.items()},
    )


# -- searches and reports --------------------------------------------------------------------------


def max_context(
    dims: ModelDims, setup: TrainSetup, method: Method, granularity: int = 2**14, limit: int = 2**28
) -> int:
    """The largest sequence length, a multiple of ``granularity`` (and of the GPU count), that fits;
    0 when not even one step fits.  Memory grows with the length, so a doubling then bisection."""
    step = math.lcm(granularity, setup.gpus)

    def fits(k: int) -> bool:
        return predict(dims, setup, method, k * step).fits

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi * step <= limit and fits(hi):
        lo, hi = hi, hi * 2
    if hi * step > limit:
        return lo * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def which_head_chunk(
    dims: ModelDims, setup: TrainSetup, seq_len: int, fused: bool = True, overlap_comm: bool = False
) -> list[Prediction]:
    """Predictions at ``seq_len`` for Ulysses and UPipe at every valid U (read ``.fits``)."""
    return [predict(dims, setup, m, seq_len) for m in methods_for(dims, setup.gpus, fused, overlap_comm)]


def which_head_chunk_report(
    dims: ModelDims, setup: TrainSetup, seq_len: int, fused: bool = True, overlap_comm: bool = False
) -> str:
    """Answer "which U do I need for N tokens": every method at N, then the recommendation (the
    largest U that fits: fewest stages, closest to Ulysses' speed)."""
    methods = methods_for(dims, setup.gpus, fused, overlap_comm)
    preds = [predict(dims, setup, m, seq_len) for m in methods]
    lines = [f"at {fmt_tokens(seq_len)} tokens on {setup.gpus} x {setup.gpu_memory_gib:g} GiB:"]
    for p in preds:
        lines.append(f"  {p.method:<22}{p.total_gib:>8.1f} GiB  {'fits' if p.fits else 'does not fit'}")
    upipe_fit = [p for p, m in zip(preds, methods) if m.kind == "upipe" and p.fits]
    if preds[0].fits:
        lines.append("-> Ulysses (ALST) already fits; UPipe is not needed at this length.")
    elif upipe_fit:
        best = max(upipe_fit, key=lambda p: int(p.method.split("U=")[1]))
        lines.append(f"-> use {best.method}: the largest head chunk that fits (fewest stages).")
    else:
        smallest = methods[1]
        lines.append(
            f"-> nothing fits; the most UPipe reaches here is {fmt_tokens(max_context(dims, setup, smallest))} "
            f"({smallest.label}). Add GPUs, offload more, or shorten the sequence."
        )
    return "\n".join(lines)


def fmt_tokens(n: int) -> str:
    """Tokens with the paper's K = 1024, M = 1024K."""
    if n >= 2**20:
        return f"{n / 2**20:.2f}".rstrip("0").rstrip(".") + "M"
    if n >= 2**10:
        return f"{n / 2**10:.0f}K"
    return str(n)


def paper_step(n: int) -> str:
    """The largest of the paper's lengths not above ``n`` (what its grid would report)."""
    fitting = [s for s in PAPER_STEPS if s <= n]
    return fmt_tokens(fitting[-1]) if fitting else "<128K"


def describe(dims: ModelDims, setup: TrainSetup) -> str:
    return (
        f"{dims.name}: H={dims.num_heads} KV={dims.num_kv_heads} d={dims.head_dim} hidden={dims.hidden_size} "
        f"intermediate={dims.intermediate_size} layers={dims.num_layers} vocab={dims.vocab_size} "
        f"({dims.total_params / 1e9:.2f}B params)\n"
        f"{setup.gpus} GPUs x {setup.gpu_memory_gib:g} GiB, ZeRO-{setup.zero_stage}, {setup.dtype}, "
        f"checkpointing={setup.checkpointing} (CPU offload={setup.offload_checkpoints}), "
        f"tiled MLP={setup.tiled_mlp}, tiled loss={setup.tiled_loss}, fused RMSNorm={setup.fused_rmsnorm}, "
        f"kernel workspace={setup.kernel}, micro-batch={setup.batch}, reserve={setup.reserve_gib:g} GiB"
    )


def plan_table(
    dims: ModelDims, setup: TrainSetup, seq_lens: Iterable[int], fused: bool = True, overlap_comm: bool = False
) -> str:
    """Predicted peak GiB per method and length (* = does not fit) and each method's max context."""
    seq_lens = list(seq_lens)
    head = f"{'method':<22}" + "".join(f"{fmt_tokens(s):>9}" for s in seq_lens) + f"{'max context':>13}{'grid':>7}"
    lines = [describe(dims, setup), "predicted peak GiB per GPU (* = does not fit)", head, "-" * len(head)]
    for m in methods_for(dims, setup.gpus, fused, overlap_comm):
        cells = []
        for s in seq_lens:
            p = predict(dims, setup, m, s)
            cells.append(f"{p.total_gib:>8.1f}{' ' if p.fits else '*'}")
        mc = max_context(dims, setup, m)
        lines.append(f"{m.label:<22}" + "".join(cells) + f"{fmt_tokens(mc):>13}{paper_step(mc):>7}")
    states = model_state_bytes(dims, setup) / GiB
    zero = zero_buffer_bytes(dims, setup) / GiB
    lines.append(
        f"fixed per GPU: model states {states:.1f} GiB, ZeRO buffers {zero:.1f} GiB, "
        f"reserve {setup.reserve_gib:g} GiB; 'grid' = the largest of the paper's lengths (128K ... 5M) that fits"
    )
    return "\n".join(lines)


def to_json(
    dims: ModelDims, setup: TrainSetup, seq_lens: Iterable[int], fused: bool = True, overlap_comm: bool = False
) -> dict:
    out: dict = {"model": asdict(dims), "setup": asdict(setup), "predictions": [], "max_context": {}}
    for m in methods_for(dims, setup.gpus, fused, overlap_comm):
        out["max_context"][m.label] = max_context(dims, setup, m)
        out["predictions"].extend(asdict(predict(dims, setup, m, s)) for s in seq_lens)
    return out
