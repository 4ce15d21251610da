"""``ds-upipe bench``: DeepSpeed-Ulysses, ALST and UPipe side by side, per rank, on the same inputs.

One invocation spawns C ranks (gloo on CPU, nccl on GPU) and runs, for every sequence length, every
method over identical inputs:

- core level (the attention core, local q/k/v in, local output out): DeepSpeed's
  ``DistributedAttention`` (the baseline) with the GQA-native local attention a user passes
  (``kernels.gqa_native_sdpa``: torch SDPA with ``enable_gqa``), ALST's ``UlyssesSPAttentionHF`` with
  transformers' "sdpa" attention, and UPipe at each valid U with ``TorchSDPAKernel`` (the same torch
  SDPA kernels with an explicit lse);
- layer level (one HF Llama decoder layer): ALST (the baseline) and UPipe fused/unfused at each U,
  through ``hf_patches``;
- mixer level (one hybrid decoder layer holding a sequence mixer of ``hf_patches.mixers``: a Qwen3.5
  gated delta net, a Nemotron-H Mamba-2 mixer): ``apply_upipe(..., mixer_head_chunk_size=U)`` at each
  valid U, the baseline being U = all heads (one stage: Ulysses' memory shape, all heads at once).

Per rank it records the peak memory (MemTracker on CPU, the CUDA allocator's peak on GPU), the
"intermediate" memory (at the core level ``memory.measure_attention``, the one definition shared with
the tests; the activation memory, peak minus the layer's weights and their gradients, at the layer
level) and
the forward+backward time; the report takes the worst rank and gives ratios to the level's baseline.
Output: a terminal table, a JSON file and a PNG plot; a progress bar while it runs.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..options import UPipeOptions
from .memory import measure_peak, tensor_bytes

LEVELS = ("core", "layer", "mixer")
#: what runs without ``levels`` (the mixer level is asked for by name)
DEFAULT_LEVELS = ("core", "layer")
#: the mixer level's kinds (``hf_patches.mixers.MIXER_KINDS`` names) -> the model whose decoder layer holds one
#: (``mixer_config``; named in the report)
MIXER_MODELS: dict[str, str] = {"gated_delta": "Qwen3.5 (Qwen3_5TextConfig)", "mamba2": "Nemotron-H (NemotronHConfig)"}
#: ``--levels ops``: the op-count benchmark (``tools.opcount``) in place of the timed levels
OPS_LEVEL = "ops"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "float16": torch.float16}


@dataclass(frozen=True)
class Method:
    """One column of the comparison.  ``name`` is unique within a level."""

    name: str
    kind: str  # "deepspeed" | "alst" | "upipe"
    #: UPipe's settings (kind "upipe"; the core level reads U and overlap_comm, the layer and mixer levels pass
    #: them all to ``apply_upipe``)
    options: UPipeOptions | None = None
    #: core level: equal documents packed into each row (1: one sequence per row)
    documents: int = 1
    #: core level: sliding window of W tokens (None: full causal)
    window: int | None = None
    #: mixer level: the mixer kind ("gated_delta" | "mamba2"); U is ``options.mixer_head_chunk_size``
    mixer: str | None = None

    @classmethod
    def upipe(cls, name: str, head_chunk_size: int, overlap_comm: bool, **kwargs: Any) -> Method:
        """A UPipe column at U = ``head_chunk_size``; ``kwargs``: ``UPipeOptions`` fields, documents, window."""
        own = {k: kwargs.pop(k) for k in ("documents", "window") if k in kwargs}
        options = UPipeOptions(head_chunk_size=head_chunk_size, overlap_comm=overlap_comm, **kwargs)
        return cls(name, "upipe", options, **own)


@dataclass
class BenchSpec:
    """What to run.  Head counts default to a Llama-like GQA layout (H=32, KV=8).  At the mixer level
    ``heads`` are the mixer's heads (gated delta: value heads; Mamba-2: SSM heads), ``kv_heads`` the
    heads or groups they read (key heads; B/C groups) and ``head_dim`` their size (key and value head
    dims; the SSM head dim)."""

    world: int = 4
    seq_lens: list[int] = field(default_factory=lambda: [2048, 4096])
    levels: tuple[str, ...] = DEFAULT_LEVELS
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64
    hidden: int | None = None  # layer level; default heads * head_dim
    intermediate: int | None = None  # layer level; default 2 * hidden
    tiled_mlp: bool = False  # layer level: DeepSpeed's TiledMLP for the MLP (as in the paper's runs)
    overlap_comm: bool = False  # UPipe prefetches the next stage's all-to-alls
    batch: int = 1
    dtype: str = "float32"
    head_chunk_sizes: list[int] | None = None  # None: every valid U
    repeats: int = 2
    warmup: int = 1
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (nccl, one GPU per rank)
    seed: int = 0
    #: UPipe x Ring: ``world`` = Ulysses degree C_u x ``ring_size``.  DeepSpeed's DistributedAttention and
    #: ALST have no ring, so with ring_size > 1 the methods are UPipe x Ring at every U valid for C_u,
    #: the baseline being U = H (Ulysses x Ring), on zigzag shards
    ring_size: int = 1
    #: core level: also run DeepSpeed and UPipe on rows of this many equal packed documents (1: not)
    documents: int = 1
    #: layer level: also run fused UPipe with ``recompute_attention_output`` (rows upipe-fused-recompute[U=u])
    recompute_attention_output: bool = False
    #: layer level: the decoder's architecture, "llama" or "qwen3" (per-head q/k RMSNorms)
    arch: str = "llama"
    #: core level: also run DeepSpeed and UPipe with a sliding window of this many tokens (None: not)
    window: int | None = None
    #: mixer level: the kinds measured (``MIXER_MODELS``), each against its own U = H
    mixers: tuple[str, ...] = tuple(MIXER_MODELS)
    #: mixer level, Mamba-2: the SSM state size N and the scan's chunk length
    ssm_state: int = 64
    ssm_chunk: int = 64

    def __post_init__(self) -> None:
        from ..schedule import valid_head_chunk_sizes

        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: must be 'cpu' or 'cuda'")
        if self.documents < 1 or any(seq % self.documents for seq in self.seq_lens):
            raise ValueError(
                f"documents={self.documents} must be >= 1 and divide every sequence length {self.seq_lens} "
                "(equal documents)"
            )
        if self.documents > 1 and self.ring_size > 1:
            raise ValueError(
                f"documents={self.documents} with ring_size={self.ring_size}: packed rows are not supported with a "
                "ring (docs/core.md); bench them with ring_size 1"
            )
        if self.window is not None:
            from ..windows import check_window

            check_window(self.window, "window")
        if self.arch not in ("llama", "qwen3"):
            raise ValueError(f"arch={self.arch!r}: choose 'llama' or 'qwen3'")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")
        bad = [lvl for lvl in self.levels if lvl not in LEVELS]
        if self.levels == (OPS_LEVEL,):
            bad = []
        if bad or not self.levels:
            raise ValueError(f"levels={list(self.levels)}: choose from {list(LEVELS)}, or {OPS_LEVEL!r} alone")
        if not self.seq_lens:
            raise ValueError("seq_lens is empty: give at least one sequence length")
        from ..layout import sequence_layout

        layout = sequence_layout(self.world, self.ring_size)  # ValueError unless ring_size divides world
        multiple = layout.sequence_multiple
        for seq in self.seq_lens:
            if seq < self.world or seq % multiple != 0:
                what = f"the group size {self.world}" if self.ring_size == 1 else f"{multiple} (zigzag ring shards)"
                raise ValueError(f"sequence length {seq} is not a positive multiple of {what}")
        if any(lvl != "mixer" for lvl in self.levels):
            valid = valid_head_chunk_sizes(self.heads, self.kv_heads, self.ulysses_size)
            for u in self.head_chunk_sizes or []:
                if u not in valid:
                    raise ValueError(
                        f"head_chunk_size {u} is invalid for heads={self.heads}, kv_heads={self.kv_heads}, "
                        f"Ulysses degree {self.ulysses_size}; valid: {valid}"
                    )
        if "mixer" in self.levels:
            self._check_mixer_level()
        if self.repeats < 0 or self.warmup < 0:
            raise ValueError(
                f"repeats and warmup must be >= 0 (0 repeats: memory only), got {self.repeats}, {self.warmup}"
            )

    def _check_mixer_level(self) -> None:
        """The mixer level's kinds and sizes, refused here rather than by ``apply_upipe`` on every rank."""
        from hf_patches.mixers.common import valid_head_chunk_sizes as valid_mixer_chunks

        unknown = [m for m in self.mixers if m not in MIXER_MODELS]
        if unknown or not self.mixers:
            raise ValueError(f"mixers={list(self.mixers)}: choose from {list(MIXER_MODELS)}")
        if self.ring_size > 1:
            raise ValueError(f"ring_size={self.ring_size}: UPipe x Ring shards attention only, not the mixer level")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"mixer level: heads={self.heads} must be a multiple of kv_heads={self.kv_heads} (key heads / groups)"
            )
        valid = valid_mixer_chunks(self.heads, self.world)
        if not valid:
            raise ValueError(f"mixer level: the group size {self.world} does not divide heads={self.heads}: no valid U")
        for u in self.head_chunk_sizes or []:
            if u not in valid:
                raise ValueError(
                    f"mixer level: U={u} is invalid for {self.heads} mixer heads on {self.world} ranks (a multiple of "
                    f"the group size dividing the heads); valid: {valid}"
                )

    @property
    def hidden_size(self) -> int:
        return self.hidden or self.heads * self.head_dim

    @property
    def ulysses_size(self) -> int:
        """C_u: the ranks UPipe's all-to-alls span (``world`` without a ring)."""
        return self.world // self.ring_size

    @property
    def intermediate_size(self) -> int:
        return self.intermediate or 2 * self.hidden_size

    @property
    def chunk_sizes(self) -> list[int]:
        from ..schedule import valid_head_chunk_sizes

        return self.head_chunk_sizes or valid_head_chunk_sizes(self.heads, self.kv_heads, self.ulysses_size)

    @property
    def mixer_chunk_sizes(self) -> list[int]:
        """The mixer level's U values: U = H (all heads at once, the baseline) first, then the others rising."""
        from hf_patches.mixers.common import valid_head_chunk_sizes as valid_mixer_chunks

        us = self.head_chunk_sizes or valid_mixer_chunks(self.heads, self.world)
        return [self.heads] + sorted(u for u in set(us) if u != self.heads)

    def methods(self, level: str) -> list[Method]:
        """The baseline first, then the others in a fixed order (at the mixer level: per kind)."""
        if level == "mixer":
            return [
                Method(f"{kind}[U={u}]", "upipe", UPipeOptions(mixer_head_chunk_size=u), mixer=kind)
                for kind in self.mixers
                for u in self.mixer_chunk_sizes
            ]
        us = self.chunk_sizes

        def upipe(name: str, u: int, **kwargs: Any) -> Method:
            return Method.upipe(name, u, self.overlap_comm, **kwargs)

        if self.ring_size > 1:  # U = H (Ulysses x Ring) is the baseline
            us = [self.heads] + [u for u in us if u != self.heads]
            ring = self.ring_size
            if level == "core":
                methods = [upipe(f"upipe-ring{ring}[U={u}]", u) for u in us]
                if self.window is not None:  # the windowed ring: chunk pairs outside the window skipped
                    w = self.window
                    methods += [upipe(f"upipe-ring{ring}[U={u}] window={w}", u, window=w) for u in us]
                return methods
            return [upipe(f"upipe-fused-ring{ring}[U={u}]", u) for u in us] + [
                upipe(f"upipe-unfused-ring{ring}[U={u}]", u, fused_projections=False) for u in us
            ]
        if level == "core":
            methods = [Method("deepspeed", "deepspeed"), Method("alst", "alst")]
            methods += [upipe(f"upipe[U={u}]", u) for u in us]
            if self.documents > 1:  # packed rows: DeepSpeed with per-document local attention first (reference)
                n = self.documents
                methods += [Method(f"deepspeed docs={n}", "deepspeed", documents=n)]
                methods += [upipe(f"upipe[U={u}] docs={n}", u, documents=n) for u in us]
            if self.window is not None:  # sliding window: DeepSpeed with the windowed kernel first (reference)
                w = self.window
                methods += [Method(f"deepspeed window={w}", "deepspeed", window=w)]
                methods += [upipe(f"upipe[U={u}] window={w}", u, window=w) for u in us]
            return methods
        return (
            [Method("alst", "alst")]
            + [upipe(f"upipe-fused[U={u}]", u) for u in us]
            + [
                upipe(f"upipe-fused-recompute[U={u}]", u, recompute_attention_output=True)
                for u in (us if self.recompute_attention_output else [])
            ]
            + [upipe(f"upipe-unfused[U={u}]", u, fused_projections=False) for u in us]
        )


@dataclass
class Measurement:
    level: str
    method: str
    kind: str
    head_chunk_size: int | None
    fused: bool | None
    seq_len: int
    peak_bytes: int  # worst rank
    intermediate_bytes: int  # worst rank
    time_s: float  # worst rank's median forward+backward
    max_abs_diff: float  # output and input gradients vs the level's baseline, worst rank
    peak_ratio: float = math.nan  # vs the level's baseline
    intermediate_ratio: float = math.nan
    time_ratio: float = math.nan
    documents: int = 1  # core level: equal documents packed per row
    window: int | None = None  # core level: sliding window (None: full causal)
    mixer: str | None = None  # mixer level: the kind (head_chunk_size is then the mixer's U)
    clock: str = "wall"  # time_s: "wall" time, or "cpu": the main thread's CPU time (the mixer level on CPU)


def packing_ratios(rows: list[Measurement]) -> list[dict[str, Any]]:
    """Per method with packed rows: its time over the same method's on one document per row (same
    sequence length): the cost of N equal documents against one document of the full row length."""
    single = {(r.level, r.seq_len, r.kind, r.head_chunk_size): r for r in rows if r.documents == 1}
    out = []
    for r in rows:
        if r.documents > 1:
            one = single[(r.level, r.seq_len, r.kind, r.head_chunk_size)]
            out.append(
                {
                    "method": r.method,
                    "seq_len": r.seq_len,
                    "documents": r.documents,
                    "time_vs_one_document": r.time_s / one.time_s,
                }
            )
    return out


def window_ratios(rows: list[Measurement]) -> list[dict[str, Any]]:
    """Per method with a sliding window: its time and intermediate memory over the same method's on full
    causal attention (same sequence length)."""
    full = {(r.level, r.seq_len, r.kind, r.head_chunk_size): r for r in rows if r.window is None and r.documents == 1}
    out = []
    for r in rows:
        if r.window is not None:
            one = full[(r.level, r.seq_len, r.kind, r.head_chunk_size)]
            out.append(
                {
                    "method": r.method,
                    "seq_len": r.seq_len,
                    "window": r.window,
                    "time_vs_causal": r.time_s / one.time_s,
                    "intermediate_vs_causal": r.intermediate_bytes / one.intermediate_bytes,
                }
            )
    return out


# -- timing one forward+backward ----------------------------------------------------------------

#: ``Measurement.clock`` -> the clock ``time_step`` reads: wall time, or the main thread's CPU time
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


def time_step(
    step: Callable[[], Any],
    repeats: int,
    warmup: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median time of ``step()`` by ``clock`` (wall time by default; all ranks start together)."""
    import torch.distributed as dist

    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = clock()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(clock() - start)
    return statistics.median(times)


# -- the attention-core level --------------------------------------------------------------------


class _HFModuleStub(torch.nn.Module):
    """ALST's forward reads ``module.training`` (and may set num_key_value_groups); nothing else."""

    def __init__(self, num_kv_groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = num_kv_groups


#: each core-level method's local attention, stated in the report
CORE_LOCAL_ATTENTION = {
    "deepspeed": "ds_upipe.kernels.gqa_native_sdpa (torch SDPA, enable_gqa)",
    "alst": "transformers' sdpa_attention_forward",
    "upipe": "ds_upipe.TorchSDPAKernel (torch SDPA ops with lse)",
    "docs=N": "deepspeed: gqa_native_sdpa per document; upipe: DocumentKernel(TorchSDPAKernel) via cu_seqlens",
}


def _per_document(local: Callable[..., torch.Tensor], cu_seqlens: list[int]) -> Callable[..., torch.Tensor]:
    """DistributedAttention's local attention run per document of the gathered [b, S, h, d] sequence
    (what a DeepSpeed user writes for packed rows without a varlen kernel); autograd by torch."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.cat([local(*(t[:, s:e] for t in (q, k, v))) for s, e in zip(cu_seqlens, cu_seqlens[1:])], dim=1)

    return attention


def _core_attention(method: Method, spec: BenchSpec, group: Any, pos: torch.Tensor) -> Callable[..., torch.Tensor]:
    """A function (q, k, v [b, s, h, d] local shards, batch_dim_idx) -> local output [b, s, h, d],
    with the local attention each method's user passes (``CORE_LOCAL_ATTENTION``); ``pos`` are the
    shard's position ids (ALST takes them)."""
    from deepspeed.sequence.layer import DistributedAttention

    from ..kernels import TorchSDPAKernel, gqa_native_sdpa
    from ..layer import UPipeDistributedAttention
    from ..windows import windowed

    seq = pos.shape[-1] * spec.world
    cu_seqlens = list(range(0, seq + 1, seq // method.documents))  # equal documents
    if method.kind == "deepspeed":
        if method.window is not None:  # DeepSpeed with ds_upipe's windowed kernel as its local attention
            return DistributedAttention(windowed(TorchSDPAKernel(causal=True), method.window), group)
        local = gqa_native_sdpa if method.documents == 1 else _per_document(gqa_native_sdpa, cu_seqlens)
        return DistributedAttention(local, group)
    if method.kind == "upipe":
        ulysses, ring = sequence_groups(spec)
        upipe = UPipeDistributedAttention(
            TorchSDPAKernel(causal=True),
            ulysses,
            head_chunk_size=method.options.head_chunk_size,
            overlap_comm=method.options.overlap_comm,
            ring_group=ring,
            window=method.window,
        )
        if method.documents == 1:
            return upipe
        return lambda q, k, v, batch_dim_idx: upipe(q, k, v, batch_dim_idx, cu_seqlens=cu_seqlens)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    alst = UlyssesSPAttentionHF(
        attn=sdpa_attention_forward,
        batch_size=spec.batch,
        attn_head_count=spec.heads,
        attn_head_size=spec.head_dim,
        kv_head_count=spec.kv_heads,
        num_hidden_layers=1,
        process_group=group,
        seq_length_is_variable=True,
    )
    stub = _HFModuleStub(spec.heads // spec.kv_heads)

    def run(q, k, v, batch_dim_idx):
        out, _ = alst(stub, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, position_ids=pos)
        return out.view(q.shape)

    return run


_GROUPS: dict[tuple[int, int], tuple[Any, Any]] = {}


def sequence_groups(spec: BenchSpec) -> tuple[Any, Any]:
    """(Ulysses group, ring group or None) of this rank: the whole world without a ring, else
    ``ds_upipe.ring.build_sequence_groups`` (built once per process; every rank calls it in the same order)."""
    import torch.distributed as dist

    if spec.ring_size == 1:
        return dist.group.WORLD, None
    key = (spec.world, spec.ring_size)
    if key not in _GROUPS:
        from ..ring import build_sequence_groups

        _GROUPS[key] = build_sequence_groups(spec.world, spec.ring_size)
    return _GROUPS[key]


def shard_positions(spec: BenchSpec, seq: int, rank: int, device: torch.device) -> torch.Tensor:
    """[b, S/C] global positions of this rank's shard: contiguous, or its zigzag share with a ring."""
    from ..ring import SequenceLayout, zigzag_positions

    pos = zigzag_positions(seq, SequenceLayout(spec.ulysses_size, spec.ring_size), rank).to(device)
    return pos.expand(spec.batch, pos.numel())


def _core_inputs(spec: BenchSpec, seq: int, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's shard of q, k, v, dout (same values for every method)."""
    gen = torch.Generator(device="cpu").manual_seed(spec.seed * 1_000_003 + seq * 31 + rank)
    s = seq // spec.world
    dtype = DTYPES[spec.dtype]
    shapes = {
        "q": (spec.batch, s, spec.heads, spec.head_dim),
        "k": (spec.batch, s, spec.kv_heads, spec.head_dim),
        "v": (spec.batch, s, spec.kv_heads, spec.head_dim),
        "dout": (spec.batch, s, spec.heads, spec.head_dim),
    }
    out = {n: torch.randn(shp, generator=gen).to(device=device, dtype=dtype) for n, shp in shapes.items()}
    out["pos"] = shard_positions(spec, seq, rank, device)
    return out


def run_core_case(method: Method, spec: BenchSpec, seq: int, rank: int, device: torch.device) -> dict[str, Any]:
    """Memory (``memory.measure_attention``: the core metric's one definition), time and results of
    one forward+backward of the attention core on this rank."""
    import torch.distributed as dist

    from .memory import measure_attention

    data = _core_inputs(spec, seq, rank, device)
    attention = _core_attention(method, spec, dist.group.WORLD, data["pos"])
    mem = measure_attention(attention, data["q"], data["k"], data["v"], data["dout"], 0)
    values = {"out": mem.out, "dq": mem.grads[0], "dk": mem.grads[1], "dv": mem.grads[2]}

    def step() -> None:
        leaves = [data[n].detach().clone().requires_grad_(True) for n in "qkv"]
        attention(*leaves, 0).backward(data["dout"])

    seconds = time_step(step, spec.repeats, spec.warmup, device) if spec.repeats else math.nan
    return {
        "peak": mem.peak_bytes,
        "intermediate": mem.intermediate_bytes,
        "time": seconds,
        "values": values,
        "clock": "wall",
    }


# -- the decoder-layer level ---------------------------------------------------------------------


def _tiled_mlp_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's TiledMLP over ceil(s / hidden) shards, as in its documented LlamaMLP patch.  Every
    rank holds an equal shard, so the shard count needs no all-reduce here."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    shards = math.ceil(x.shape[-2] / x.shape[-1])
    params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
    return TiledMLP.apply(mlp_forward, mlp, x, shards, params)


def layer_config(spec: BenchSpec, layers: int = 1) -> Any:
    """The tiny config of the layer level (``spec.arch``, no download)."""
    from .models import tiny_config

    return tiny_config(
        spec.arch,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        num_hidden_layers=layers,
        max_position_embeddings=max(spec.seq_lens),
    )


def build_layer(
    method: Method, spec: BenchSpec, device: torch.device, long_context: bool = False
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder layer, rotary embedding) of a one-layer model (``spec.arch``) patched for ``method``
    (same weights for every method: same seed).  ``long_context``: its norms and MLP tiled as training's
    long-context stack tiles them (``hf_patches.apply_long_context_stack``, the default tiles) instead of
    ``spec.tiled_mlp``'s bench TiledMLP."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(layer_config(spec)).to(device=device, dtype=DTYPES[spec.dtype])
    if method.kind == "alst":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from .hf_memory import alst_attention_function

        # left registered for the rest of the rank's process (UPipe's patched layers do not read it)
        ALL_ATTENTION_FUNCTIONS["sdpa"] = alst_attention_function(model.model, spec.batch)
    elif method.kind == "upipe":
        from hf_patches import apply_upipe

        ulysses, ring = sequence_groups(spec)
        apply_upipe(model, ulysses, method.options, ring_group=ring)
    else:
        raise ValueError(f"method {method.name!r} has no decoder-layer implementation")
    layer = model.model.layers[0]
    if long_context:
        from hf_patches import apply_long_context_stack

        apply_long_context_stack(model, tiled_norm=True, tiled_mlp=True)
    elif spec.tiled_mlp:
        import types

        layer.mlp.forward = types.MethodType(_tiled_mlp_forward, layer.mlp)
    return layer.train(), model.model.rotary_emb


def hidden_inputs(spec: BenchSpec, seq: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's layer input x0 and output gradient dy [b, S/C, hidden] (seeded per length and rank)."""
    dtype = DTYPES[spec.dtype]
    s = seq // spec.world
    gen = torch.Generator(device="cpu").manual_seed(spec.seed * 1_000_003 + seq * 31 + rank)
    x0 = torch.randn(spec.batch, s, spec.hidden_size, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(spec.batch, s, spec.hidden_size, generator=gen).to(device=device, dtype=dtype)
    return x0, dy


def layer_inputs(
    rotary: torch.nn.Module, spec: BenchSpec, seq: int, rank: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """This rank's layer input x0, output gradient dy, position ids and RoPE cos/sin (seeded per
    length and rank): what every layer-level measurement runs on."""
    x0, dy = hidden_inputs(spec, seq, rank, device)
    pos = shard_positions(spec, seq, rank, device)
    with torch.no_grad():
        cos, sin = rotary(x0, pos)
    return x0, dy, pos, cos, sin


def layer_case(
    layer: torch.nn.Module, rotary: torch.nn.Module, spec: BenchSpec, seq: int, rank: int, device: torch.device
) -> dict[str, Any]:
    """Memory (and, when ``spec.repeats``, time) of one forward+backward of ``layer`` on this rank's
    shard.  "intermediate" at this level is the activation memory: peak minus the layer's weights
    and their gradients."""
    x0, dy, pos, cos, sin = layer_inputs(rotary, spec, seq, rank, device)
    return measure_layer(layer, x0, dy, spec, device, position_embeddings=(cos, sin), position_ids=pos)


def measure_layer(
    layer: torch.nn.Module,
    x0: torch.Tensor,
    dy: torch.Tensor,
    spec: BenchSpec,
    device: torch.device,
    *,
    clock: str = "wall",
    **kwargs: Any,
) -> dict[str, Any]:
    """``layer_case``'s measurement of ``layer(x, **kwargs).backward(dy)`` (the layer and mixer levels):
    peak, activation memory (peak minus weights and weight gradients), time by ``CLOCKS[clock]``, outputs
    and gradients."""
    result: dict[str, torch.Tensor] = {}

    def step(x: torch.Tensor, keep: bool = False) -> None:
        y = layer(x, **kwargs)
        y.backward(dy)
        if keep:
            result.update(y=y.detach(), dx=x.grad)

    layer.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    tracked = [t for v in kwargs.values() for t in (v if isinstance(v, tuple) else (v,)) if torch.is_tensor(t)]
    peak = measure_peak(lambda: step(x, keep=True), [layer, x, dy, *tracked], device)
    weights = tensor_bytes(*layer.parameters()) + tensor_bytes(*(p.grad for p in layer.parameters()))
    result.update({f"grad.{n}": p.grad for n, p in layer.named_parameters() if p.grad is not None})
    layer.zero_grad(set_to_none=True)
    seconds = math.nan
    if spec.repeats:
        seconds = time_step(
            lambda: step(x0.clone().requires_grad_(True)), spec.repeats, spec.warmup, device, CLOCKS[clock]
        )
        layer.zero_grad(set_to_none=True)
    return {"peak": peak, "intermediate": peak - weights, "time": seconds, "values": result, "clock": clock}


def run_layer_case(method: Method, spec: BenchSpec, seq: int, rank: int, device: torch.device) -> dict[str, Any]:
    """One HF Llama decoder layer patched for ``method``, forward+backward, on this rank's shard."""
    layer, rotary = build_layer(method, spec, device)
    return layer_case(layer, rotary, spec, seq, rank, device)


# -- the mixer level ---------------------------------------------------------------------------


def mixer_config(spec: BenchSpec, kind: str) -> Any:
    """A one-layer config of the model holding ``kind`` (``MIXER_MODELS``; the tiny configs' one builder,
    ``tools.models.tiny_config``): the mixer sized by ``spec`` (heads, kv_heads, head_dim; Mamba-2:
    ssm_state, ssm_chunk), its layer type the config's only one."""
    from .models import tiny_config

    common = dict(
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_hidden_layers=1, use_cache=False
    )
    if kind == "gated_delta":
        return tiny_config(
            "qwen3_5",
            **common,
            layer_types=["linear_attention"],
            linear_num_value_heads=spec.heads,
            linear_num_key_heads=spec.kv_heads,
            linear_key_head_dim=spec.head_dim,
            linear_value_head_dim=spec.head_dim,
        )
    if kind == "mamba2":
        return tiny_config(
            "nemotron_h",
            **common,
            layers_block_type=["mamba"],
            mamba_num_heads=spec.heads,
            n_groups=spec.kv_heads,
            mamba_head_dim=spec.head_dim,
            ssm_state_size=spec.ssm_state,
            chunk_size=spec.ssm_chunk,
        )
    raise ValueError(f"mixer {kind!r}: choose one of {list(MIXER_MODELS)}")


def mixer_clock(device: torch.device) -> str:
    """The mixer level's clock (``CLOCKS``): on CPU the main thread's CPU time (C ranks share a few cores there,
    so wall time measures the scheduler; the gloo exchanges run on their own threads), on CUDA wall time."""
    return "cpu" if device.type == "cpu" else "wall"


def run_mixer_case(method: Method, spec: BenchSpec, seq: int, rank: int, device: torch.device) -> dict[str, Any]:
    """The decoder layer of a one-layer hybrid model holding ``method.mixer``, patched by ``apply_upipe`` with
    ``method.options`` (its ``mixer_head_chunk_size``), forward+backward on this rank's shard (same weights and
    inputs for every U: same seeds)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_patches import apply_upipe

    torch.manual_seed(spec.seed)
    config = mixer_config(spec, method.mixer)
    model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=DTYPES[spec.dtype])
    apply_upipe(model, dist.group.WORLD, method.options)
    layer = model.model.layers[0].train()
    x0, dy = hidden_inputs(spec, seq, rank, device)
    # Qwen3.5's decoder layer takes position embeddings positionally; its linear-attention layers do not read them
    kwargs = {"position_embeddings": None} if method.mixer == "gated_delta" else {}
    result = measure_layer(layer, x0, dy, spec, device, clock=mixer_clock(device), **kwargs)
    # a head's parameters (A_log, dt_bias, its conv channels) get their gradient on the rank running the head,
    # which depends on U: compare the sums over the group, the gradients the optimizer steps with
    for name, value in result["values"].items():
        if name.startswith("grad."):
            dist.all_reduce(value)
    return result


# -- the rank program and the launcher -----------------------------------------------------------


def _max_abs_diff(values: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max((values[k].double() - ref[k].double()).abs().max().item() for k in ref)


def _rank_main(rank: int, world: int, spec: BenchSpec) -> list[tuple]:
    """One rank (spawned by ``ranks.run_ranks``, deepspeed.comm up: ALST talks through it): every case
    in order, a progress report after each; returns the rank's rows."""
    from .ranks import report_progress

    device = torch.device(spec.device, rank) if spec.device == "cuda" else torch.device("cpu")
    rows = []
    for level in spec.levels:
        runner = {"core": run_core_case, "layer": run_layer_case, "mixer": run_mixer_case}[level]
        for seq in spec.seq_lens:
            # per (documents per row, window, mixer kind): the first method's
            references: dict[tuple[int, int | None, str | None], dict[str, torch.Tensor]] = {}
            for method in spec.methods(level):
                res = runner(method, spec, seq, rank, device)
                reference = references.setdefault((method.documents, method.window, method.mixer), res["values"])
                diff = _max_abs_diff(res["values"], reference)
                rows.append((level, method, seq, res["peak"], res["intermediate"], res["time"], diff, res["clock"]))
                del res
                report_progress()
    return rows


def run_bench(spec: BenchSpec, show_progress: bool = True, timeout: float = 3600) -> list[Measurement]:
    """Spawn ``spec.world`` ranks, run every case, return the worst-rank measurements with ratios."""
    from tqdm import tqdm

    from .ranks import run_ranks

    if spec.device == "cuda" and torch.cuda.device_count() < spec.world:
        raise ValueError(f"world={spec.world} needs {spec.world} GPUs; {torch.cuda.device_count()} visible")
    total = sum(len(spec.methods(lvl)) * len(spec.seq_lens) for lvl in spec.levels)
    with tqdm(total=total, desc="ds-upipe bench", unit="case", disable=not show_progress) as bar:
        per_rank = run_ranks(
            _rank_main,
            spec.world,
            spec,
            use_deepspeed=True,
            backend="nccl" if spec.device == "cuda" else "gloo",
            threads=max(1, (os.cpu_count() or 1) // spec.world),
            timeout=timeout,
            on_progress=lambda rank: bar.update(1) if rank == 0 else None,
        )
    return combine_ranks(per_rank)


def combine_ranks(per_rank: list[list[tuple]]) -> list[Measurement]:
    """Worst rank per case, then ratios to the level's baseline at the same sequence length."""
    rows: list[Measurement] = []
    for cases in zip(*per_rank):
        level, method, seq = cases[0][:3]
        u = None if method.options is None else method.options.head_chunk_size
        rows.append(
            Measurement(
                level=level,
                method=method.name,
                kind=method.kind,
                head_chunk_size=method.options.mixer_head_chunk_size if level == "mixer" else u,
                # the core level has no projections to fuse, the mixer level no attention
                fused=None if method.options is None or level != "layer" else method.options.fused_projections,
                seq_len=seq,
                peak_bytes=max(c[3] for c in cases),
                intermediate_bytes=max(c[4] for c in cases),
                time_s=max(c[5] for c in cases),
                max_abs_diff=max(c[6] for c in cases),
                documents=method.documents,
                window=method.window,
                mixer=method.mixer,
                clock=cases[0][7],
            )
        )
    baselines = {(m.level, m.seq_len, m.mixer): m for m in rows if _is_first(m, rows)}
    for m in rows:
        base = baselines[(m.level, m.seq_len, m.mixer)]
        m.peak_ratio = m.peak_bytes / base.peak_bytes
        m.intermediate_ratio = m.intermediate_bytes / base.intermediate_bytes if base.intermediate_bytes else math.nan
        m.time_ratio = m.time_s / base.time_s
    return rows


def _is_first(m: Measurement, rows: list[Measurement]) -> bool:
    """The baseline of a level is its first method (DeepSpeed at the core, ALST at the layer; with a ring,
    UPipe x Ring at U = H: Ulysses x Ring; at the mixer level, per kind, U = H: all heads at once)."""
    first = next(r for r in rows if (r.level, r.seq_len, r.mixer) == (m.level, m.seq_len, m.mixer))
    return first is m


# -- reporting -----------------------------------------------------------------------------------


#: what "intermediate" means per level (the JSON field ``intermediate_bytes``)
INTERMEDIATE = {
    "core": "peak minus q, k, v, out, dout, dq, dk, dv (q, k, v require grad; dout materialized)",
    "layer": "activation memory: peak minus the layer's weights and weight gradients",
    "mixer": "activation memory: peak minus the layer's weights and weight gradients",
}


def format_table(rows: list[Measurement]) -> str:
    """A plain-text table, one block per level, ratios against the level's baseline."""
    lines = []
    for level in dict.fromkeys(r.level for r in rows):
        base = next(r.method for r in rows if r.level == level)
        if level == "mixer":
            base = "U = H of each mixer (all heads at once: Ulysses' memory shape)"
        mid = "interm." if level == "core" else "activ."
        seconds = "fwd+bwd cpu s" if any(r.clock == "cpu" for r in rows if r.level == level) else "fwd+bwd s"
        lines.append(
            f"[{level} level] ratios (x) vs {base}; per-rank memory of the worst rank in MiB; {mid} = "
            f"{INTERMEDIATE[level]}"
        )
        if level == "core":
            lines.append("local attention: " + "; ".join(f"{k}: {v}" for k, v in CORE_LOCAL_ATTENTION.items()))
        if level == "mixer":
            kinds = dict.fromkeys(r.mixer for r in rows if r.level == level)
            lines.append("decoder layers: " + "; ".join(f"{k}: {MIXER_MODELS[k]}" for k in kinds))
        header = f"{'method':<26}{'seq':>9}{'peak':>10}{'x':>6}{mid:>10}{'x':>6}{seconds:>15}{'x':>6}{'maxdiff':>10}"
        lines += [header, "-" * len(header)]
        for r in (r for r in rows if r.level == level):
            lines.append(
                f"{r.method:<26}{r.seq_len:>9}{r.peak_bytes / 2**20:>10.1f}{r.peak_ratio:>6.2f}"
                f"{r.intermediate_bytes / 2**20:>10.1f}{r.intermediate_ratio:>6.2f}"
                f"{r.time_s:>15.3f}{r.time_ratio:>6.2f}{r.max_abs_diff:>10.1e}"
            )
        lines.append("")
    packed = packing_ratios(rows)
    if packed:
        lines.append("[packed rows] fwd+bwd time of N equal documents per row / one document of the full row length")
        lines += [f"{p['method']:<22}{p['seq_len']:>9}{p['time_vs_one_document']:>8.3f}" for p in packed]
        lines.append("")
    windows = window_ratios(rows)
    if windows:
        lines.append("[sliding window] fwd+bwd time and intermediate memory / the same method on full causal attention")
        lines += [
            f"{w['method']:<28}{w['seq_len']:>9}{w['time_vs_causal']:>8.3f}{w['intermediate_vs_causal']:>8.3f}"
            for w in windows
        ]
        lines.append("")
    return "\n".join(lines)


def write_json(path: str | Path, spec: BenchSpec, rows: list[Measurement], extra: dict | None = None) -> None:
    import deepspeed
    import transformers

    payload = {
        "spec": asdict(spec),
        "environment": {
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0) if spec.device == "cuda" else "cpu",
            "memory_measured_with": "torch.cuda.max_memory_allocated" if spec.device == "cuda" else "MemTracker",
            "git": _git_state(),
            "cpus": os.cpu_count(),
        },
        "intermediate_bytes": INTERMEDIATE,
        "core_local_attention": CORE_LOCAL_ATTENTION,
        "mixer_models": MIXER_MODELS,
        "results": [asdict(r) for r in rows],
        "packing": packing_ratios(rows),
        "windows": window_ratios(rows),
        **(extra or {}),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")


def _git_state() -> str | None:
    """The checkout's commit (and whether it had local changes), when run from a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "")


def plot(path: str | Path, rows: list[Measurement], title: str = "") -> None:
    """Per level: peak memory, intermediate memory and time vs sequence length, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(dict.fromkeys(r.level for r in rows))
    fig, axes = plt.subplots(len(levels), 3, figsize=(16, 4.5 * len(levels)), squeeze=False)
    for row_axes, level in zip(axes, levels):
        level_rows = [r for r in rows if r.level == level]
        for method in dict.fromkeys(r.method for r in level_rows):
            pts = sorted((r for r in level_rows if r.method == method), key=lambda r: r.seq_len)
            xs = [r.seq_len for r in pts]
            style = "--" if pts[0].kind != "upipe" else "-"
            row_axes[0].plot(xs, [r.peak_bytes / 2**20 for r in pts], style, marker="o", label=method)
            row_axes[1].plot(xs, [r.intermediate_bytes / 2**20 for r in pts], style, marker="o", label=method)
            row_axes[2].plot(xs, [r.time_s for r in pts], style, marker="o", label=method)
        seconds = "fwd+bwd CPU time (s)" if level_rows[0].clock == "cpu" else "fwd+bwd time (s)"
        for ax, ylabel in zip(row_axes, ("peak memory per rank (MiB)", "intermediate memory (MiB)", seconds)):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length (tokens)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{level} level" + (" (deepspeed: gqa_native_sdpa)" if level == "core" else ""))
            ax.grid(True, alpha=0.3)
        row_axes[2].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
