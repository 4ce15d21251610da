"""Input checks that fail identically on every rank.

A check that only some ranks fail would leave the others blocked in the next collective.  So every
rank's shapes, dtypes and module settings are exchanged first (one tiny all_gather), and every rank
evaluates the same rules on the same gathered data, raising the same ValueError.

The settings are exchanged because ranks that disagree on them would issue different sequences of
all-to-alls (head_chunk_size sets the stage plan, overlap_comm the order of the exchanges, a kernel's
backward gathers the output where a generic callable's recompute does not), which hangs or aborts
the group; or would compute a different function on each rank (causal, softmax_scale).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import SequenceLayout
from .schedule import resolve_head_chunk_size

#: every torch dtype in a fixed order, so a dtype travels as its index (same torch on every rank)
_DTYPES: list[torch.dtype] = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


@dataclass(frozen=True)
class RuntimeSettings:
    """What every rank's UPipe runtime of a sequence-parallel group must agree on: the one record the
    core layer's input exchange and the HF model-level input check both exchange (``UPipeRuntime.settings``)
    and ``check_settings`` compares.  A difference changes the stage plan, the order of the all-to-alls
    (which leaves the ranks' collectives mismatched: abort or hang) or the function computed."""

    #: U as configured (None: U = C, the core layer's default; the HF path sends its plan's U)
    head_chunk_size: int | None
    scatter_idx: int = 2
    overlap_comm: bool = False
    #: the local attention is an AttentionKernel (lse-based backward) rather than a generic callable
    #: (run as a CallableKernel, recomputed in backward): their backward exchanges differ
    uses_kernel: bool = True
    causal: bool | None = None  # None for a generic callable
    softmax_scale: float | None = None
    #: ranks of the ring group (1 = no ring attention) and whether its K/V exchange overlaps compute
    ring_size: int = 1
    ring_overlap: bool = False
    #: 16-bit dK/dV summed in their own dtype and sent per stage, fused dK/dV per stage in every dtype (the
    #: order of the all-to-alls changes)
    accumulate_in_input_dtype: bool = False
    #: HF path: projections per stage (fused), and backward recomputing each stage's output (one more
    #: kernel forward per stage; fused only); always False in the core layer
    fused_projections: bool = False
    recompute_attention_output: bool = False
    #: KV-shared layers attend with their producer's exchanged keys and values (no exchange of their own)
    share_exchanged_kv: bool = True
    #: the model's head counts where the runtime knows them (HF: the config; None in the core layer,
    #: whose exchange compares the q/k/v shapes instead)
    num_heads: int | None = None
    num_kv_heads: int | None = None
    #: sliding window of the call (None: full causal), and its attention sinks' ``sinks_shape_code``
    #: (-1: none): both change the result, and sinks the autograd inputs
    window: int | None = None
    sinks: int = -1

    def encode(self) -> list[int]:
        """Two ints per field (a type tag, the value): None, bool, int or a float's bits."""
        row: list[int] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                row += [0, 0]
            elif isinstance(value, bool):
                row += [1, int(value)]
            elif isinstance(value, int):
                row += [2, value]
            else:
                row += [3, struct.unpack("<q", struct.pack("<d", float(value)))[0]]
        return row

    @staticmethod
    def decode(row: list[int]) -> RuntimeSettings:
        values: list[object] = []
        for tag, value in zip(row[0::2], row[1::2]):
            if tag == 3:
                values.append(struct.unpack("<d", struct.pack("<q", value))[0])
            else:
                values.append((None, bool(value), value)[tag])
        return RuntimeSettings(*values)


_SETTINGS_FIELDS = 2 * len(fields(RuntimeSettings))


@dataclass(frozen=True)
class TensorInfo:
    ndim: int
    dims: list[int]  # [-1] * 4 unless 4-D
    dtype: str


@dataclass(frozen=True)
class RankInputs:
    """One rank's row of the exchange, decoded."""

    batch_dim_idx: int
    query: TensorInfo
    key: TensorInfo
    value: TensorInfo
    settings: RuntimeSettings
    #: ``DocumentBoundaries.fingerprint()`` of packed-sequence boundaries ([] when none were given)
    documents: tuple[int, ...] = ()


def _describe(t: Tensor) -> list[int]:
    dims = list(t.shape) if t.dim() == 4 else [-1] * 4
    return [t.dim(), *dims, _DTYPES.index(t.dtype)]


def _decode_tensor(row: list[int]) -> TensorInfo:
    return TensorInfo(ndim=row[0], dims=row[1:5], dtype=str(_DTYPES[row[5]]).removeprefix("torch."))


def _decode(row: list[int]) -> RankInputs:
    q, k, v = (_decode_tensor(row[1 + 6 * i : 7 + 6 * i]) for i in range(3))
    has_documents, *documents = row[19 + _SETTINGS_FIELDS :]
    settings = RuntimeSettings.decode(row[19 : 19 + _SETTINGS_FIELDS])
    return RankInputs(row[0], q, k, v, settings, tuple(documents) if has_documents else ())


def gather_inputs(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    batch_dim_idx: int,
    settings: RuntimeSettings,
    group: dist.ProcessGroup | None,
    ring_group: dist.ProcessGroup | None = None,
    documents: list[int] | None = None,
) -> list[RankInputs]:
    """Every rank's batch_dim_idx, q/k/v shapes and dtypes, and module settings (one all_gather).

    With a ring group, the Ulysses group's rows are then gathered over the ring (a second tiny
    all_gather), so every rank of the whole C_u x R sequence-parallel group decides on all C_u x R rows
    (in sequence-parallel rank order, ring index major): a bad shard on one node fails every node.

    ``documents`` is the fingerprint of packed-sequence boundaries (``ds_upipe.packing``), None without."""
    mine = torch.tensor(
        _row(query, key, value, batch_dim_idx, settings, documents), dtype=torch.long, device=query.device
    )
    rows = _gather(mine.unsqueeze(0), group, ring_group)
    return [_decode(row) for row in rows.tolist()]


class CheckedInputs:
    """The input exchange of one runtime (per layer of the core, ``UPipeRuntime.checked_inputs``)
    without a host sync once a layout has been checked.

    ``gather_inputs`` + ``check_inputs`` read the gathered rows on the host (``.tolist()``): a device
    sync per layer on CUDA, which stalls the host's kernel launches every layer.  Here each rank
    still all_gathers its row every call (a tiny collective, so every rank issues the same
    collectives whatever it has cached), but a row (this rank's own: shapes, dtypes, settings,
    document fingerprint) that passed before with every rank's row equal to it skips the host read:
    the gathered rows are compared with it on the device (``torch._assert_async``, no sync; no
    tensor is kept between calls).  A rank whose row is new checks on the host and raises the usual
    ValueError; if another rank's row changed while this one's did not, the device comparison fails
    (an error, not a hang).

    Why the exchange is not skipped for a checked layout: a rank that changes alone (its inputs or
    settings) back to a layout every rank had checked would then skip it while another rank's new
    row is exchanged, and the ranks would meet in different collectives (a size error on gloo, a
    hang on NCCL) instead of the ValueError every rank raises here.  ``validate_inputs=False`` (the
    layer's) drops the exchange where the caller guarantees the inputs agree; the HF path checks once
    per model forward, outside the layers.  Bounded: the last ``max_layouts`` layouts are kept
    (packed batches, whose boundaries change per batch, always check on the host)."""

    def __init__(self, max_layouts: int = 8) -> None:
        self.max_layouts = max_layouts
        self._passed: dict[tuple[int, ...], tuple[int, int, int]] = {}
        #: how many calls read the rows on the host (for tests)
        self.host_checks = 0

    def __call__(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        batch_dim_idx: int,
        settings: RuntimeSettings,
        group: dist.ProcessGroup | None,
        ring_group: dist.ProcessGroup | None = None,
        documents: list[int] | None = None,
        ulysses_size: int | None = None,
    ) -> tuple[int, int, int]:
        """``check_inputs``'s (num_heads, num_kv_heads, head_chunk_size) of every rank's inputs."""
        row = _row(query, key, value, batch_dim_idx, settings, documents)
        mine = torch.tensor(row, dtype=torch.long, device=query.device).unsqueeze(0)
        rows = _gather(mine, group, ring_group)
        layout = tuple(row)
        if layout in self._passed:
            # no sync on CUDA (a device-side assert); on CPU a RuntimeError at once
            torch._assert_async((rows == mine).all())
            return self._passed[layout]
        self.host_checks += 1
        values = rows.tolist()
        result = check_inputs([_decode(r) for r in values], ulysses_size=ulysses_size)
        if all(r == row for r in values):  # only a layout every rank shares is checked on the device later
            if len(self._passed) >= self.max_layouts:
                self._passed.pop(next(iter(self._passed)))
            self._passed[layout] = result
        return result


def _row(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    batch_dim_idx: int,
    settings: RuntimeSettings,
    documents: list[int] | None,
) -> list[int]:
    doc_fields = [0, 0, 0, 0] if documents is None else [1, *documents]
    return [batch_dim_idx, *_describe(query), *_describe(key), *_describe(value), *settings.encode(), *doc_fields]


def _gather(mine: Tensor, group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None) -> Tensor:
    rows = _all_gather_rows(mine, group)
    return rows if ring_group is None else _all_gather_rows(rows, ring_group)


def _all_gather_rows(rows: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """[n, f] rows of every rank of ``group``, concatenated in group rank order."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return rows
    everyone = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(everyone, rows.contiguous(), group=group)
    return torch.cat(everyone)


def mismatched_settings(per_rank: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """``{key: [value of rank 0, rank 1, ...]}`` for every key whose values differ (a missing key is None): the
    one comparison of per-rank records (the ds_configs' agreement, a vision-language sample's digest)."""
    keys = sorted({key for settings in per_rank for key in settings})
    values = {key: [settings.get(key) for settings in per_rank] for key in keys}
    return {key: vals for key, vals in values.items() if any(v != vals[0] for v in vals)}


def _per_rank(values: list[object]) -> str:
    return ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))


#: how ``check_settings`` names each field of ``RuntimeSettings``
_SETTING_LABELS = {
    "head_chunk_size": "head_chunk_size",
    "scatter_idx": "scatter_idx",
    "overlap_comm": "overlap_comm",
    "uses_kernel": "local_attention is an AttentionKernel",
    "causal": "the kernel's causal",
    "softmax_scale": "the kernel's softmax_scale",
    "ring_size": "ring_size (ranks of the ring group)",
    "ring_overlap": "ring_overlap",
    "accumulate_in_input_dtype": "accumulate_in_input_dtype",
    "fused_projections": "fused_projections",
    "recompute_attention_output": "recompute_attention_output",
    "share_exchanged_kv": "share_exchanged_kv",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "window": "the sliding window",
    "sinks": "the attention sinks' shape (-1: none)",
}


def check_settings(settings: list[RuntimeSettings]) -> RuntimeSettings:
    """The group's common settings (every rank's, in rank order); one ValueError listing the per-rank
    values of every field that differs.  The one cross-rank settings check of the core layer and the
    HF paths (``UPipeRuntime.settings``)."""
    differ = []
    for f in fields(RuntimeSettings):
        values = [getattr(s, f.name) for s in settings]
        if len(set(values)) != 1:
            label = _SETTING_LABELS[f.name]
            differ.append(f"{label} differs across the ranks of the sequence-parallel group ({_per_rank(values)})")
    if differ:
        raise ValueError(
            "; ".join(differ) + ": every rank must build UPipe with the same settings (UPipeDistributedAttention's "
            "or hf_patches.apply_upipe's arguments, or the ds_config's \"upipe\" block, and an equally configured "
            "local attention kernel, with plain nn.Linear projections for fused mode), since they decide the stage "
            "plan, the order of the all-to-alls or the result"
        )
    return settings[0]


def check_inputs(rows: list[RankInputs], ulysses_size: int | None = None) -> tuple[int, int, int]:
    """Validate all ranks' inputs and settings; returns (num_heads, num_kv_heads, resolved head_chunk_size).

    ``rows`` are every rank's of the sequence-parallel group; with a ring, C_u x R of them, and
    ``ulysses_size`` (C_u, default all rows) is the group the heads are split over."""
    group_size = len(rows) if ulysses_size is None else ulysses_size
    settings = check_settings([row.settings for row in rows])
    if settings.scatter_idx != 2:
        raise ValueError(
            f"scatter_idx={settings.scatter_idx} is not supported: heads must be dim 2 ([b, s, h, d] or [s, b, h, d])"
        )
    if len(rows) != group_size * settings.ring_size:
        raise ValueError(
            f"{len(rows)} ranks exchanged their inputs, but the Ulysses group has {group_size} and the ring group "
            f"{settings.ring_size}: every Ulysses group must be paired with ring groups of the same size "
            "(build both with ds_upipe.ring.build_sequence_groups)"
        )
    if settings.ring_size > 1 and not settings.uses_kernel:
        raise ValueError(
            f"ring attention (ring_size={settings.ring_size}) needs an AttentionKernel as local_attention: its "
            "log-sum-exp merges the blocks of the ring; a generic callable returns no lse"
        )
    _check_documents(rows, settings)
    for rank, row in enumerate(rows):
        if row.batch_dim_idx not in (0, 1):
            raise ValueError(
                f"batch_dim_idx={row.batch_dim_idx} (rank {rank}): must be 0 for [b, s, h, d] or 1 for [s, b, h, d]"
            )
        q, k, v = row.query, row.key, row.value
        for name, info in (("query", q), ("key", k), ("value", v)):
            if info.ndim != 4:
                raise ValueError(f"{name} must be 4-D ([b, s, h, d] or [s, b, h, d]); rank {rank} got {info.ndim}-D")
        if k.dims[:3] != v.dims[:3]:
            raise ValueError(
                f"key shape {k.dims} and value shape {v.dims} differ on rank {rank} (only their head dims may: "
                "latent attention's values are narrower)"
            )
        if settings.ring_size > 1 and v.dims[3] != q.dims[3]:
            raise ValueError(
                f"ring attention (ring_size={settings.ring_size}) with a value head dim {v.dims[3]} other than the "
                f"query/key head dim {q.dims[3]} (latent attention) is not supported: run it with ring_size 1"
            )
        if q.dims[:2] != k.dims[:2] or q.dims[3] != k.dims[3]:
            raise ValueError(
                f"query {q.dims} and key {k.dims} must agree on batch, sequence and head_dim (rank {rank})"
            )
    layouts = [row.batch_dim_idx for row in rows]
    if len(set(layouts)) != 1:
        raise ValueError(f"batch_dim_idx differs across ranks: {layouts}")
    for name in ("query", "key", "value"):
        dtypes = [getattr(row, name).dtype for row in rows]
        if len(set(dtypes)) != 1:
            raise ValueError(
                f"{name} dtype differs across the ranks of the sequence-parallel group ({_per_rank(dtypes)}): "
                "the all-to-alls need one dtype on every rank"
            )
    layout = layouts[0]  # 0 = [b, s, ...], 1 = [s, b, ...]
    seq_lens = [row.query.dims[1 - layout] for row in rows]
    if len(set(seq_lens)) != 1:
        raise ValueError(
            f"sequence shard lengths differ across ranks: {seq_lens}. Every rank must hold an equal shard "
            "(pad the sequence to a multiple of the sequence-parallel size), and batch_dim_idx must match "
            f"the tensor layout (batch_dim_idx={layout} means {'[b, s, h, d]' if layout == 0 else '[s, b, h, d]'})"
        )
    if settings.ring_size > 1:
        check_ring_block(seq_lens[0], group_size, settings.ring_size)
    batches = [row.query.dims[layout] for row in rows]
    if len(set(batches)) != 1:
        raise ValueError(f"batch sizes differ across ranks: {batches} (or batch_dim_idx does not match the layout)")
    head_dims = [(row.query.dims[3], row.value.dims[3]) for row in rows]
    if len(set(head_dims)) != 1:
        raise ValueError(f"(query/key, value) head dims differ across ranks: {_per_rank(head_dims)}")
    heads = {(row.query.dims[2], row.key.dims[2]) for row in rows}
    if len(heads) != 1:
        raise ValueError(f"head counts differ across ranks: {sorted(heads)}")
    num_heads, num_kv_heads = heads.pop()
    check_window_and_sinks(settings, num_heads)
    u = resolve_ulysses_head_chunk_size(
        num_heads, num_kv_heads, group_size, settings.ring_size, settings.head_chunk_size
    )
    return num_heads, num_kv_heads, u


def _check_documents(rows: list[RankInputs], settings: RuntimeSettings) -> None:
    """Packed-sequence boundaries: given on all ranks or none, the same everywhere, with a kernel, no ring."""
    given = [bool(row.documents) for row in rows]
    if not any(given):
        return
    if not all(given) or len({row.documents for row in rows}) != 1:
        raise ValueError(
            f"packed-sequence boundaries (cu_seqlens) differ across the ranks of the sequence-parallel group (given "
            f"per rank: {given}): every rank must pass the same global cu_seqlens (e.g. from the global position_ids, "
            "ds_upipe.packing.documents_from_positions)"
        )
    check_packing_supported(settings.uses_kernel, settings.ring_size)


def check_window_and_sinks(settings: RuntimeSettings, num_heads: int) -> None:
    """A sliding window needs a causal AttentionKernel; sinks need an AttentionKernel (their backward
    reads its lse) and one floating logit per query head."""
    if settings.window is not None:
        if settings.window < 1:
            raise ValueError(
                f"window must be a positive int (tokens a query sees, itself included), got {settings.window}"
            )
        if not settings.uses_kernel:
            raise ValueError(
                f"a sliding window (window={settings.window}) needs an AttentionKernel as local_attention (ds_upipe "
                "runs the window itself); a generic callable cannot be restricted to a window"
            )
        if not settings.causal:
            raise ValueError(
                f"a sliding window (window={settings.window}) is causal (key j visible to query i iff i - W < j <= i), "
                "but the kernel is not causal"
            )
    if settings.sinks == -1:
        return
    if not settings.uses_kernel:
        raise ValueError(
            "attention sinks need an AttentionKernel as local_attention (they rescale its output by its lse); a "
            "generic callable returns no lse"
        )
    if settings.sinks != num_heads:
        got = "not a floating-point 1-D tensor" if settings.sinks == -2 else f"{settings.sinks} values"
        raise ValueError(
            f"sinks must be a floating-point tensor of shape [{num_heads}] (one logit per query head, the global "
            f"num_heads), got {got}"
        )


def check_packing_supported(uses_kernel: bool, ring_size: int) -> None:
    """Packed sequences need an AttentionKernel (run per document with its lse) and no ring."""
    if not uses_kernel:
        raise ValueError(
            "packed sequences (cu_seqlens) need an AttentionKernel as local_attention (it runs per document with "
            "its lse); a generic callable cannot be restricted to documents"
        )
    if ring_size > 1:
        raise ValueError(
            f"packed sequences (cu_seqlens) are not supported with ring attention (ring_size={ring_size}): "
            "use UPipe without a ring group (ring_group=None) for packed rows"
        )


def check_ring_block(shard_len: int, ulysses_size: int, ring_size: int) -> None:
    """Zigzag ring attention splits each ring rank's block (its Ulysses group's shards, C_u x s tokens)
    into two equal chunks: ValueError unless that block is even."""
    block = shard_len * ulysses_size
    if block % 2:
        multiple = SequenceLayout(ulysses_size, ring_size).sequence_multiple
        raise ValueError(
            f"sequence shard length {shard_len} with Ulysses degree {ulysses_size} gives ring blocks of {block} "
            f"tokens: zigzag ring attention (ring_size={ring_size}) splits each ring block into two equal chunks, "
            f"so it must be even; pad the global sequence ({block * ring_size} tokens) to a multiple of {multiple}"
        )


def resolve_ulysses_head_chunk_size(
    num_heads: int, num_kv_heads: int, ulysses_size: int, ring_size: int, head_chunk_size: int | None
) -> int:
    """``resolve_head_chunk_size`` over the Ulysses degree; with a ring, its errors say that the heads
    are split over C_u = sequence_parallel_size / ring_size, not over the whole group."""
    try:
        return resolve_head_chunk_size(num_heads, num_kv_heads, ulysses_size, head_chunk_size)
    except ValueError as err:
        if ring_size == 1:
            raise
        raise ValueError(
            f"with ring_size={ring_size} the heads are split over the Ulysses degree {ulysses_size} = "
            f"sequence_parallel_size {ulysses_size * ring_size} / ring_size {ring_size} (a larger ring_size "
            f"lowers it), not over all {ulysses_size * ring_size} ranks: {err}"
        ) from None
