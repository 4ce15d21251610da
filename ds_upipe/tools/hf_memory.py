"""Per-rank peak activation memory of one attention block / one decoder layer: UPipe vs ALST.

Measured with torch's ``MemTracker`` (deterministic, counts every tensor storage, works with
collectives), on a one-layer Llama model built from a config, on this rank's sequence shard.
"Peak activation memory" is the peak of all tracked memory minus the parameters and parameter
gradients held at that moment, in units of the layer's hidden-state size (b * s_local * hidden *
element size), so the numbers do not depend on the sequence length once activations dominate.

What one measurement runs (forward + backward, by default after one untracked warm-up step):
``part(x).backward(dout)`` with x a [b, s_local, hidden] leaf that requires grad and dout a
materialized output gradient made before the step (the block metric of docs/benchmarks.md, "Metric
definitions": inside a model the block's input needs a gradient and its output gradient is a real
tensor; the broadcast scalar gradient of ``out.sum()`` would hide one hidden state).  The input,
dout, the input's gradient and the RoPE cos/sin count as activations for every method alike.

Methods: ``"upipe_fused"``, ``"upipe_fused_recompute"`` and ``"upipe_unfused"`` patch the model with ``apply_upipe``;
``"alst"`` runs DeepSpeed's ``UlyssesSPAttentionHF`` as the integration registers it
(``alst_attention_function``: ``register_with_transformers`` once per process and head layout, over
the whole world, so ALST needs the group to be the world and ``deepspeed.comm`` initialized).  ALST's
wrapper replaces transformers' "sdpa" attention only during its measurement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from hf_patches import apply_upipe

from .memory import peak_snapshot

MethodName = Literal["upipe_fused", "upipe_fused_recompute", "upipe_unfused", "alst"]
Part = Literal["attention", "layer"]
METHODS: tuple[MethodName, ...] = ("upipe_fused", "upipe_fused_recompute", "upipe_unfused", "alst")
PARTS: tuple[Part, ...] = ("attention", "layer")

#: ALST's attention wrapper per head layout (see alst_attention_function)
_ALST_WRAPPERS: dict[tuple, Any] = {}


@dataclass
class MemoryMeasurement:
    method: str
    part: str
    seq_local: int
    group_size: int
    peak_total: int  # bytes, everything tracked
    parameters: int  # bytes of parameters at the peak
    gradients: int  # bytes of parameter gradients at the peak
    activation: int  # peak_total - parameters - gradients
    unit_bytes: int  # b * s_local * hidden * element size

    @property
    def units(self) -> float:
        return self.activation / self.unit_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "units": self.units}


def build_one_layer_model(
    *,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 16,
    hidden_size: int = 512,
    intermediate_size: int = 512,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Module:
    """A one-layer ``LlamaModel`` (sdpa attention) with the given shapes, on CPU."""
    from transformers import LlamaModel

    from .models import tiny_config

    config = tiny_config(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1 << 22,
        use_cache=False,
    )
    torch.manual_seed(seed)
    return LlamaModel(config).to(dtype)


def alst_attention_function(model: nn.Module, batch: int) -> Any:
    """ALST's attention wrapper for this model over the whole world: the integration's registration
    (``sp_setup.register_alst``, DeepSpeed's own ``register_with_transformers``), made once per
    process and head layout and cached, since each registration builds new sequence-parallel groups;
    transformers' attention registry is left as it was."""
    from ..integration.sp_setup import register_alst, restore_attention_functions

    cfg = model.config
    impl = cfg._attn_implementation
    key = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, impl, batch, dist.get_world_size())
    if key not in _ALST_WRAPPERS:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        register_alst(model, dist.get_world_size(), batch)
        _ALST_WRAPPERS[key] = ALL_ATTENTION_FUNCTIONS[impl]
        restore_attention_functions()
    return _ALST_WRAPPERS[key]


def forget_alst_registrations() -> None:
    """Drop the cached ALST wrappers (after DeepSpeed's sequence-parallel groups were released, so that
    the next ``alst_attention_function`` registers again)."""
    _ALST_WRAPPERS.clear()


def measure_peak_activation(
    method: MethodName,
    part: Part,
    *,
    group: dist.ProcessGroup | None = None,
    seq_local: int = 4096,
    batch: int = 1,
    head_chunk_size: int | None = None,
    seed: int = 0,
    warmup: bool = True,
    repeats: int = 1,
    accumulate_in_input_dtype: bool = False,
    **shape: Any,
) -> MemoryMeasurement:
    """Peak activation memory of this rank for one forward + backward of ``part``.

    Args:
        method: "upipe_fused", "upipe_fused_recompute" (``recompute_attention_output``), "upipe_unfused"
            or "alst" (DeepSpeed's UlyssesSPAttentionHF).
        part: "attention" (one layer's self_attn module, hidden_states in, o_proj out) or
            "layer" (one whole decoder layer).
        group: the sequence-parallel group (None: the world; ALST always uses the world).
        seq_local: this rank's sequence shard length; the global sequence is seq_local * C.
        head_chunk_size: UPipe's U (None: U = C).
        warmup: run one untracked step first (lazy caches are then not counted; they are tiny).
        accumulate_in_input_dtype: UPipe with ``accumulate_dtype: "input"`` (fused: dK/dV per stage, no
            round-sized accumulator; ignored by ALST).
        repeats: tracked steps; the least peak is kept.  Over gloo a finished collective's tensors are
            released by gloo's worker thread, which may run after the main thread has moved on, so a
            step can now and then count a freed buffer at its peak on one rank; more than one repeat
            filters that timing out (NCCL releases at ``wait``).
        shape: the model's heads, sizes and dtype: ``build_one_layer_model``'s keywords and defaults.
    Every rank of the group must call it with the same arguments (it runs collectives).
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if method not in METHODS or part not in PARTS:
        raise ValueError(f"method must be one of {METHODS} and part one of {PARTS}; got {method!r}, {part!r}")
    group_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    model = build_one_layer_model(**shape, seed=seed)
    hidden_size, dtype = model.config.hidden_size, model.embed_tokens.weight.dtype
    original_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if method == "alst":
        if group_size != dist.get_world_size():
            raise ValueError("ALST registers its sequence-parallel groups over the whole world; pass group=None")
        ALL_ATTENTION_FUNCTIONS["sdpa"] = alst_attention_function(model, batch)
    else:
        apply_upipe(
            model,
            group,
            head_chunk_size=head_chunk_size,
            fused_projections=method != "upipe_unfused",
            recompute_attention_output=method == "upipe_fused_recompute",
            accumulate_in_input_dtype=accumulate_in_input_dtype,
        )
    try:
        layer = model.layers[0]
        gen = torch.Generator().manual_seed(seed + 1 + rank)
        x = torch.randn(batch, seq_local, hidden_size, generator=gen, dtype=dtype).requires_grad_(True)
        position_ids = torch.arange(rank * seq_local, (rank + 1) * seq_local).unsqueeze(0)
        cos, sin = model.rotary_emb(x, position_ids)
        # the output gradient a model hands the block: a materialized tensor (docs/benchmarks.md, "Metric
        # definitions"), not the broadcast scalar gradient of out.sum(), which costs no memory
        dout = torch.randn(batch, seq_local, hidden_size, generator=gen, dtype=dtype)

        def step() -> None:
            kwargs = dict(attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))
            out = layer.self_attn(hidden_states=x, **kwargs)[0] if part == "attention" else layer(x, **kwargs)
            out.backward(dout)

        def reset() -> None:
            model.zero_grad(set_to_none=True)
            x.grad = None

        if warmup:  # lazy caches (plan indices, ALST shapes) are not activations
            step()
            reset()
        peaks = []
        for i in range(max(1, repeats)):
            if i:
                reset()
            peaks.append(next(iter(peak_snapshot(step, [model, x, dout, cos, sin, position_ids]).values())))
        peak = min(peaks, key=lambda p: p["Total"])
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original_sdpa
    params, grads = peak.get("Parameter", 0), peak.get("Gradient", 0)
    total = peak["Total"]
    return MemoryMeasurement(
        method=method,
        part=part,
        seq_local=seq_local,
        group_size=group_size,
        peak_total=total,
        parameters=params,
        gradients=grads,
        activation=total - params - grads,
        unit_bytes=batch * seq_local * hidden_size * torch.empty((), dtype=dtype).element_size(),
    )


def measure_memory_table(
    *, group: dist.ProcessGroup | None = None, methods: tuple[str, ...] = METHODS, **kwargs: Any
) -> list[MemoryMeasurement]:
    """``measure_peak_activation`` for every method and part (same keyword arguments)."""
    return [measure_peak_activation(m, p, group=group, **kwargs) for m in methods for p in PARTS]


def format_memory_table(rows: list[MemoryMeasurement]) -> str:
    """A markdown table: activation units per method for the attention block and the whole layer."""
    by = {(r.method, r.part): r for r in rows}
    methods = list(dict.fromkeys(r.method for r in rows))
    lines = ["| method | attention block | decoder layer |", "|---|---|---|"]
    for m in methods:
        cells = [f"{by[(m, p)].units:.2f}" if (m, p) in by else "-" for p in PARTS]
        lines.append(f"| {m} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)
