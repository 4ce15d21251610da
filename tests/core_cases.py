"""Rank-side bodies of the core tests (importable by spawned processes)."""

from __future__ import annotations

import gc
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds_upipe import MathKernel, TorchSDPAKernel, UPipeDistributedAttention

HEAD_CONFIGS = {  # name -> (H, Hkv) for C in {2, 4}
    "mha": (16, 16),
    "gqa4": (16, 4),
    "mqa": (16, 1),
    "kv_lt_c": (16, 2),  # Hkv < C at C=4 (at C=2 it is plain GQA 8:1)
}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference_attention(q, k, v, causal):
    """Single-process full-sequence attention in float64 ([b, S, h, d]), autograd by torch."""
    g = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kh, vh = kh.repeat_interleave(g, dim=1), vh.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal).transpose(1, 2)


def make_inputs(seed, batch, seq, heads, kv_heads, head_dim, dtype, value_dim=None):
    """q, k, v, dout ([b, S, h, d]); v and dout of ``value_dim`` (latent attention's value head dim) when given."""
    gen = torch.Generator().manual_seed(seed)
    dv = value_dim or head_dim
    shape_q, shape_k, shape_v, shape_o = (
        (batch, seq, heads, head_dim),
        (batch, seq, kv_heads, head_dim),
        (batch, seq, kv_heads, dv),
        (batch, seq, heads, dv),
    )
    q, k, v, dout = (torch.randn(s, generator=gen, dtype=torch.float64) for s in (shape_q, shape_k, shape_v, shape_o))
    return [t.to(dtype).to(torch.float64) for t in (q, k, v, dout)]  # values representable in dtype


def relative_error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def local_shard(t, rank, world, batch_dim_idx):
    """Rank's sequence shard of a [b, S, h, d] tensor, in the requested layout, as a leaf."""
    s = t.shape[1] // world
    shard = t[:, rank * s : (rank + 1) * s]
    return (shard.transpose(0, 1) if batch_dim_idx == 1 else shard).contiguous()


def run_case(
    rank,
    world,
    layout,
    heads,
    kv_heads,
    u,
    batch,
    causal,
    dtype,
    attention,
    seed=0,
    seq_per_rank=6,
    overlap=False,
    group=None,
    head_dim=8,
    value_dim=None,
):
    q, k, v, dout = make_inputs(seed, batch, seq_per_rank * world, heads, kv_heads, head_dim, dtype, value_dim)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = reference_attention(*full, causal)
    ref_out.backward(dout)
    locals_ = [local_shard(t, rank, world, layout).to(dtype).requires_grad_(True) for t in (q, k, v)]
    group = dist.group.WORLD if group is None else group
    attn = UPipeDistributedAttention(attention, group, head_chunk_size=u, overlap_comm=overlap)
    out = attn(*locals_, layout)
    out.backward(local_shard(dout, rank, world, layout).to(dtype))
    errors = {"out": relative_error(out, local_shard(ref_out.detach(), rank, world, layout))}
    for name, loc, ref in zip("qkv", locals_, full):
        errors[f"d{name}"] = relative_error(loc.grad, local_shard(ref.grad, rank, world, layout))
    return errors


def kernel_matrix(rank, world):
    """The issue's matrix for the SDPA kernel in three dtypes (float64 also with overlapped
    communication); returns failures (empty = pass) and the number of cases run."""
    failures, count = [], 0
    for (name, (h, hkv)), layout, u_factor, batch, causal, dtype in itertools.product(
        HEAD_CONFIGS.items(), (0, 1), (1, 2, None), (1, 2), (True, False), TOLERANCE
    ):
        u = h if u_factor is None else u_factor * world
        for overlap in (False, True) if dtype == torch.float64 else (False,):
            kernel = TorchSDPAKernel(causal=causal)
            errs = run_case(rank, world, layout, h, hkv, u, batch, causal, dtype, kernel, overlap=overlap)
            count += 1
            if max(errs.values()) > TOLERANCE[dtype]:
                failures.append((name, layout, u, batch, causal, str(dtype), overlap, errs))
    return failures, count


def other_attention_matrix(rank, world):
    """Math reference kernel and a generic (recomputed) callable, float64."""

    def generic(q, k, v, *args, causal=True, **kwargs):  # DistributedAttention's contract, [b, S, h, d]
        return reference_attention(q, k, v, causal)

    failures, count = [], 0
    for (name, (h, hkv)), layout, u_factor, causal in itertools.product(
        HEAD_CONFIGS.items(), (0, 1), (1, 2, None), (True, False)
    ):
        u = h if u_factor is None else u_factor * world
        for label, attention in (("math", MathKernel(causal=causal)), ("generic", _Generic(causal))):
            errs = run_case(rank, world, layout, h, hkv, u, 2, causal, torch.float64, attention, overlap=causal)
            count += 1
            if max(errs.values()) > 1e-10:
                failures.append((label, name, layout, u, causal, errs))
    return failures, count


def packed_documents(seq, world, seed):
    """Random document lengths of a packed row of ``seq`` tokens (shard length seq / world): a
    single-token document, one shorter than a shard, one crossing at least one shard boundary."""
    shard = seq // world
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, max(1, shard // 2), shard + 3]  # a doc crossing the shard boundary (and shard 1's end)
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(1, 2 * shard, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - seq
    lengths = [n for n in lengths if n > 0]
    perm = torch.randperm(len(lengths), generator=gen).tolist()
    lengths = [lengths[i] for i in perm]
    return [0, *itertools.accumulate(lengths)]


def per_document_reference(q, k, v, rows):
    """Every document attended as its own sequence ([b, S, h, d]; rows: cu_seqlens per batch row)."""
    out = []
    for r, cu in enumerate(rows):
        docs = [reference_attention(*(t[r : r + 1, s:e] for t in (q, k, v)), True) for s, e in zip(cu, cu[1:])]
        out.append(torch.cat(docs, dim=1))
    return torch.cat(out)


def packed_case(
    rank, world, layout, heads, kv_heads, u, batch, kernel, overlap, seed=0, seq_per_rank=6, head_dim=8, value_dim=None
):
    """UPipe given cu_seqlens == each document run alone, float64 (forward and dq/dk/dv)."""
    seq = seq_per_rank * world
    q, k, v, dout = make_inputs(seed, batch, seq, heads, kv_heads, head_dim, torch.float64, value_dim)
    rows = [packed_documents(seq, world, seed + r) for r in range(batch)]
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = per_document_reference(*full, rows)
    ref_out.backward(dout)
    locals_ = [local_shard(t, rank, world, layout).requires_grad_(True) for t in (q, k, v)]
    attn = UPipeDistributedAttention(kernel, dist.group.WORLD, head_chunk_size=u, overlap_comm=overlap)
    out = attn(*locals_, layout, cu_seqlens=rows if batch > 1 else rows[0])
    out.backward(local_shard(dout, rank, world, layout))
    errors = {"out": relative_error(out, local_shard(ref_out.detach(), rank, world, layout))}
    for name, loc, ref in zip("qkv", locals_, full):
        errors[f"d{name}"] = relative_error(loc.grad, local_shard(ref.grad, rank, world, layout))
    return errors


def packed_matrix(rank, world):
    """Packed rows (DocumentKernel around the sdpa and math kernels): GQA and KV < C, U in {C, H},
    both layouts, one row shared / one per batch row, overlap on and off."""
    failures, count = [], 0
    for (name, (h, hkv)), layout, u_factor, batch, overlap in itertools.product(
        (("gqa4", HEAD_CONFIGS["gqa4"]), ("kv_lt_c", HEAD_CONFIGS["kv_lt_c"])), (0, 1), (1, None), (1, 2), (False, True)
    ):
        u = h if u_factor is None else u_factor * world
        kernel = MathKernel() if (layout, batch) == (1, 2) else TorchSDPAKernel()
        errs = packed_case(rank, world, layout, h, hkv, u, batch, kernel, overlap, seed=count)
        count += 1
        if max(errs.values()) > 1e-10:
            failures.append((name, layout, u, batch, overlap, type(kernel).__name__, errs))
    return failures, count


#: latent attention's shapes: values narrower than queries and keys (DeepSeek: 128 against 192)
LATENT_HEAD_DIM, LATENT_VALUE_DIM = 12, 8


def latent_matrix(rank, world):
    """A value head dim other than the q/k head dim (multi-head latent attention after its up-projection):
    the sdpa kernel (its padded CPU flash path), the math kernel and a generic callable, GQA and KV < C,
    U in {C, H}, both layouts, overlap on and off; bfloat16 (dK/dV summed per round in the float32
    accumulator); packed rows.  Returns failures and the number of cases."""
    failures, count = [], 0
    d, dv = LATENT_HEAD_DIM, LATENT_VALUE_DIM
    for (name, (h, hkv)), layout, u_factor, kernel_name in itertools.product(
        (("gqa4", HEAD_CONFIGS["gqa4"]), ("kv_lt_c", HEAD_CONFIGS["kv_lt_c"])), (0, 1), (1, None), ("sdpa", "math")
    ):
        u = h if u_factor is None else u_factor * world
        kernel = TorchSDPAKernel() if kernel_name == "sdpa" else MathKernel()
        errs = run_case(rank, world, layout, h, hkv, u, 2, True, torch.float64, kernel, overlap=layout == 1,
                        head_dim=d, value_dim=dv)  # fmt: skip
        count += 1
        if max(errs.values()) > 1e-10:
            failures.append((name, layout, u, kernel_name, errs))
    extra = {
        "generic": lambda: run_case(
            rank, world, 0, 16, 4, world, 2, True, torch.float64, _Generic(True), head_dim=d, value_dim=dv
        ),  # fmt: skip
        "bf16": lambda: run_case(
            rank, world, 0, 16, 4, 16, 2, True, torch.bfloat16, TorchSDPAKernel(), head_dim=d, value_dim=dv
        ),  # fmt: skip
        "packed": lambda: packed_case(
            rank, world, 0, 16, 4, world, 2, TorchSDPAKernel(), True, head_dim=d, value_dim=dv
        ),  # fmt: skip
    }
    for label, case in extra.items():
        errs = case()
        count += 1
        if max(errs.values()) > (2e-2 if label == "bf16" else 1e-10):
            failures.append((label, errs))
    return failures, count


def runtimes_case(rank, world):
    """Per-layer runtimes (``ds_upipe.runtime``): two differently configured layers in one process
    (U = C with the SDPA kernel on packed rows, U = H with the math kernel, overlap and a window),
    interleaved (forward A, forward B, backward A, backward B), then a layer on a group destroyed and
    created again; each equals its float64 reference.  Returns relative errors by name."""
    seq, heads, kv_heads = 6 * world, 16, 4
    q, k, v, dout = make_inputs(11, 2, seq, heads, kv_heads, 8, torch.float64)
    rows = [packed_documents(seq, world, 20 + r) for r in range(2)]
    window = 5
    full_a, full_b = ([t.clone().requires_grad_(True) for t in (q, k, v)] for _ in range(2))
    refs = [per_document_reference(*full_a, rows), masked_reference(*full_b, window=window)]
    for ref in refs:
        ref.backward(dout)
    layer_a = UPipeDistributedAttention(TorchSDPAKernel(), dist.group.WORLD)
    layer_b = UPipeDistributedAttention(MathKernel(), dist.group.WORLD, head_chunk_size=heads, overlap_comm=True)
    assert layer_a.runtime is not layer_b.runtime
    locals_a, locals_b = ([local_shard(t, rank, world, 0).requires_grad_(True) for t in (q, k, v)] for _ in range(2))
    outs = [layer_a(*locals_a, 0, cu_seqlens=rows), layer_b(*locals_b, 0, window=window)]
    errors = {}
    for name, out, locs, full, ref in zip("ab", outs, (locals_a, locals_b), (full_a, full_b), refs):
        out.backward(local_shard(dout, rank, world, 0))
        errors[f"out_{name}"] = relative_error(out, local_shard(ref.detach(), rank, world, 0))
        for t, loc, glob in zip("qkv", locs, full):
            errors[f"d{t}_{name}"] = relative_error(loc.grad, local_shard(glob.grad, rank, world, 0))
    # a destroyed group and a new one in its place: the new layer's runtime knows only the new group
    for attempt in range(2):
        group = dist.new_group(list(range(world)))
        errs = run_case(
            rank, world, 0, heads, kv_heads, 2 * world, 1, True, torch.float64, TorchSDPAKernel(), group=group
        )
        errors.update({f"{n}_group{attempt}": e for n, e in errs.items()})
        dist.destroy_process_group(group)
    errors["ring_subgroups_of_a_destroyed_group"] = _ring_subgroups_reused(world)
    return errors


def _ring_subgroups_reused(world):
    """1.0 if the Ulysses / ring subgroups that ``sp_setup.upipe_groups`` made for a destroyed
    sequence-parallel group come back for the new group created in its place (the ``id()``-keyed
    cache issue 22 found: the new group object often reuses the old one's id), else 0.0."""
    from ds_upipe.integration.config import parse_config
    from ds_upipe.integration.sp_setup import upipe_groups

    ds_config = {"sequence_parallel_size": world, "zero_optimization": {"stage": 3}, "upipe": {"ring_size": 2}}
    settings = parse_config({**ds_config, "train_micro_batch_size_per_gpu": 1})
    subgroups = []
    for _ in range(3):
        group = dist.new_group(list(range(world)))
        subgroups.append(upipe_groups(group, settings))
        assert upipe_groups(group, settings) is subgroups[-1]  # kept while the group lives
        dist.destroy_process_group(group)
        del group
        gc.collect()  # free the destroyed group object, so that the next one may take its id
    ulysses = {id(u) for u, _ in subgroups}
    return float(len(ulysses) != len(subgroups))


def exchange_layout_case(rank, world):
    """``comm``'s heads-to-sequence exchange of two packed tensors (b = 2): every received [b, n, S, d]
    tensor equals the whole sequence of its heads; without ``own_storage`` all are strided views of one
    receive buffer (no copy), with it each is contiguous token-major storage of its own."""
    from ds_upipe.comm import heads_send_buffer, select_heads, start_heads_exchange

    b, s, d, n = 2, 3, 4, 2  # n heads per rank and tensor
    full = [torch.randn(b, s * world, world * n, d, generator=torch.Generator().manual_seed(j)) for j in range(2)]
    local = [t[:, rank * s : (rank + 1) * s] for t in full]
    heads = torch.arange(world * n).flip(0)  # destination c gets heads[c * n : (c + 1) * n]
    mine = heads[rank * n : (rank + 1) * n]
    want = [t.index_select(2, mine).transpose(1, 2) for t in full]

    def write(views):
        for t, view in zip(local, views):
            select_heads(t, heads, view)

    out = {}
    for own in (False, True):
        send, layout = heads_send_buffer(write, [world * n] * 2, (b, s, d), torch.float32, torch.device("cpu"), world)
        got = start_heads_exchange(send, layout, world, None, async_op=False, own_storage=own).wait()
        storages = {t.untyped_storage().data_ptr() for t in got}
        token_major = all(t.transpose(1, 2).is_contiguous() for t in got)
        out[own] = (
            max((g - w).abs().max().item() for g, w in zip(got, want)),
            len(storages),
            token_major,
        )
    return out


def other_attention_and_packing(rank, world):
    """One spawn: ``other_attention_matrix``, ``packed_matrix``, ``window_sink_matrix`` and
    ``window_sink_errors``."""
    return {
        "other": other_attention_matrix(rank, world),
        "packed": packed_matrix(rank, world),
        "windows": window_sink_matrix(rank, world),
        "window_errors": window_sink_errors(rank, world),
        "runtimes": runtimes_case(rank, world),
        "exchange_layout": exchange_layout_case(rank, world),
        "latent": latent_matrix(rank, world),
    }


class _Generic:
    """A plain callable (not an AttentionKernel) in DistributedAttention's layout for batch_dim_idx=0/1."""

    def __init__(self, causal):
        self.causal = causal

    def __call__(self, q, k, v, *args, **kwargs):
        # UPipe passes the layout it was called with; detect [S, b, ...] by the batch_dim kwarg-free rule:
        # tests call with batch sizes 2 and S >= 12, so a leading dim of 2 means [b, S, h, d].
        seq_first = q.shape[0] != 2
        if seq_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = reference_attention(q, k, v, self.causal)
        return out.transpose(0, 1) if seq_first else out


def deepspeed_parity(rank, world):
    """Same inputs through DeepSpeed's DistributedAttention and UPipe (float64): max abs differences."""
    from deepspeed.sequence.layer import DistributedAttention

    diffs = []
    for (h, hkv), layout, u_factor, causal in itertools.product(
        ((16, 16), (16, 4)), (0, 1), (1, 2, None), (True, False)
    ):
        if hkv < world:
            continue  # DeepSpeed itself refuses fewer KV heads than ranks
        kernel = TorchSDPAKernel(causal=causal)
        q, k, v, dout = make_inputs(1, 2, 6 * world, h, hkv, 8, torch.float64)
        grads = []
        for module in (
            DistributedAttention(_LayoutAdapter(kernel, layout), dist.group.WORLD),
            UPipeDistributedAttention(
                _LayoutAdapter(kernel, layout),
                dist.group.WORLD,
                head_chunk_size=None if u_factor is None else u_factor * world,
            ),
            UPipeDistributedAttention(
                kernel, dist.group.WORLD, head_chunk_size=h if u_factor is None else u_factor * world
            ),
        ):
            inputs = [local_shard(t, rank, world, layout).requires_grad_(True) for t in (q, k, v)]
            out = module(*inputs, layout)
            out.backward(local_shard(dout, rank, world, layout))
            grads.append([out.detach(), *(t.grad for t in inputs)])
        for other in grads[1:]:
            diffs.append(max((a - b).abs().max().item() for a, b in zip(grads[0], other)))
    return diffs


class _LayoutAdapter:
    """An AttentionKernel's DistributedAttention callable for a given layout (DeepSpeed hands the
    local attention [b, S, h, d] for batch_dim_idx=0 and [S, b, h, d] for 1)."""

    def __init__(self, kernel, layout):
        self.kernel, self.layout = kernel, layout

    def __call__(self, q, k, v, *args, **kwargs):
        if self.layout == 1:
            return self.kernel(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)
        return self.kernel(q, k, v)


def bad_input_errors(rank, world):
    """Each bad input must raise ValueError on every rank with the same message, and leave no rank
    blocked (a barrier follows every case)."""

    def attempt(make, layout=0, u=None, kernel=None, cu_seqlens=None, **module_kwargs):
        try:
            attn = UPipeDistributedAttention(
                kernel or TorchSDPAKernel(), dist.group.WORLD, head_chunk_size=u, **module_kwargs
            )
            q, k, v = make()
            attn(q, k, v, layout, cu_seqlens=cu_seqlens).sum().backward()
            result = "no error"
        except ValueError as err:
            result = str(err)
        dist.barrier()
        return result

    def tensors(seq=6, heads=16, kv=4, batch=2, kv_seq=None, layout_dims=None, dtype=torch.float32):
        shape_q = layout_dims or (batch, seq, heads, 8)
        shape_k = (batch, kv_seq or seq, kv, 8) if layout_dims is None else (*layout_dims[:2], kv, 8)
        return lambda: tuple(torch.randn(s, dtype=dtype, requires_grad=True) for s in (shape_q, shape_k, shape_k))

    def generic(q, k, v, *args, **kwargs):  # DistributedAttention's callable contract, [b, S, h, d]
        return reference_attention(q, k, v, True)

    return {
        "u_not_multiple_of_c": attempt(tensors(), u=world + 1),
        "u_not_dividing_h": attempt(tensors(heads=12, kv=12), u=8),
        "u_splits_kv_group": attempt(tensors(heads=48, kv=8), u=16),
        "heads_not_divisible": attempt(tensors(heads=world + 1, kv=1)),
        "kv_incompatible": attempt(tensors(heads=24, kv=6)),
        "uneven_shards": attempt(tensors(seq=6 + rank)),
        "batch_dim_idx": attempt(tensors(), layout=2),
        "key_query_mismatch": attempt(tensors(kv_seq=5)),
        "constructor_bad_u": attempt(tensors(), u=0),
        # ranks configured differently: each setting alone would change the collectives or the result
        "u_differs_across_ranks": attempt(tensors(), u=world * (1 + rank % 2)),
        "u_none_vs_int": attempt(tensors(), u=None if rank == 0 else 2 * world),
        "overlap_differs": attempt(tensors(), overlap_comm=rank == 0),
        "accumulate_differs": attempt(tensors(), accumulate_in_input_dtype=rank == 0),
        "kernel_vs_callable": attempt(tensors(), kernel=generic if rank == 0 else None),
        "causal_differs": attempt(tensors(), kernel=TorchSDPAKernel(causal=rank != 0)),
        "scale_differs": attempt(tensors(), kernel=TorchSDPAKernel(softmax_scale=0.5 if rank == 0 else None)),
        "scatter_idx_on_one_rank": attempt(tensors(), scatter_idx=3 if rank == 0 else 2),
        "dtype_differs": attempt(tensors(dtype=torch.float64 if rank == 0 else torch.float32)),
        # packed sequences: the same cu_seqlens on every rank, valid, with a kernel
        "cu_seqlens_differ": attempt(tensors(), cu_seqlens=[0, 3 + rank % 2, 6 * world]),
        "cu_seqlens_on_one_rank": attempt(tensors(), cu_seqlens=[0, 3, 6 * world] if rank == 0 else None),
        "cu_seqlens_bad_end": attempt(tensors(), cu_seqlens=[0, 3, 6 * world - 1]),
        "cu_seqlens_rows": attempt(tensors(), cu_seqlens=[[0, 6 * world]] * 3),
        "cu_seqlens_generic": attempt(tensors(), kernel=generic, cu_seqlens=[0, 3, 6 * world]),
        "ok_after_errors": attempt(tensors()),
    }


def memory_by_head_chunk(rank, world, seq_per_rank=64, batch=1, heads=32, kv_heads=8, head_dim=64):
    """Intermediate peak (bytes, ``ds_upipe.tools.memory.measure_attention``) of DeepSpeed's DistributedAttention
    with the GQA-native local attention a user passes (``gqa_native_sdpa``), of DeepSpeed with a
    ``TorchSDPAKernel`` instance as its local attention (GQA-native too), of UPipe at each valid U,
    float32, and of UPipe at U = C with the plain ``gqa_native_sdpa`` (a ``CallableKernel``,
    recomputed in backward)."""
    from deepspeed.sequence.layer import DistributedAttention

    from ds_upipe.kernels import gqa_native_sdpa
    from ds_upipe.schedule import valid_head_chunk_sizes
    from ds_upipe.tools.memory import measure_attention

    gen = torch.Generator().manual_seed(rank)
    shape_q, shape_kv = (batch, seq_per_rank, heads, head_dim), (batch, seq_per_rank, kv_heads, head_dim)
    q, k, v, dout = (torch.randn(s, generator=gen) for s in (shape_q, shape_kv, shape_kv, shape_q))

    def deepspeed_at_best(local_attention):
        # the least of 3 runs: gloo's finished all-to-all work sometimes frees one of DeepSpeed's exchange
        # buffers late (seen: exactly one 512 KiB buffer more on one rank in a full-suite run), which
        # MemTracker then counts in the peak; the baseline is taken at its best
        attention = DistributedAttention(local_attention, dist.group.WORLD)
        runs = [measure_attention(attention, q, k, v, dout, 0) for _ in range(3)]
        return min(runs, key=lambda m: m.intermediate_bytes)

    results = {
        "deepspeed": deepspeed_at_best(gqa_native_sdpa),
        "deepspeed_kernel": deepspeed_at_best(TorchSDPAKernel(causal=True)),
    }
    for u in valid_head_chunk_sizes(heads, kv_heads, world):
        attn = UPipeDistributedAttention(TorchSDPAKernel(causal=True), dist.group.WORLD, head_chunk_size=u)
        results[u] = measure_attention(attn, q, k, v, dout, 0)
    callable_attn = UPipeDistributedAttention(gqa_native_sdpa, dist.group.WORLD, head_chunk_size=world)
    results["upipe_callable"] = measure_attention(callable_attn, q, k, v, dout, 0)
    return {key: (m.intermediate_bytes, m.peak_bytes, m.seconds) for key, m in results.items()}


# -- sliding windows and attention sinks --------------------------------------------------------------


def masked_reference(q, k, v, window=None, sinks=None, rows=None, spans=None):
    """Single-process attention in float64 ([b, S, h, d]) with an explicit S x S mask: causal, restricted
    to transformers' sliding window (key j visible to query i iff i - W < j <= i) and to each document of
    ``rows`` (cu_seqlens per batch row); with ``sinks`` as GPT-OSS's eager_attention_forward adds them (one
    logit per head appended to the scores, softmaxed with them, its column dropped); ``spans`` ([(start, end)]
    per batch row): Gemma 3's image overlay, every token of a span seeing the whole span, before the window
    (``AND(sliding_window_overlay, OR(causal, blockwise))``)."""
    b, seq, h, d = q.shape
    g = h // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    mask = (j <= i).expand(b, seq, seq).clone()
    for r, row in enumerate(spans or []):
        for s, e in row:
            mask[r, s:e, s:e] = True
    if window is not None:
        mask &= j > i - window
    if rows is not None:
        for r, cu in enumerate(rows):
            doc = torch.zeros(seq, dtype=torch.long)
            for n, (s, e) in enumerate(zip(cu, cu[1:])):
                doc[s:e] = n
            mask[r] &= doc[:, None] == doc[None, :]
    scores = (qh @ kh.transpose(-1, -2)) / d**0.5
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        column = sinks.reshape(1, -1, 1, 1).expand(b, -1, seq, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return (probs @ vh).transpose(1, 2)


def _error(got, want):
    """Max abs difference relative to the reference's scale, at least 1: with W = 1 (a query sees itself
    only) dq and dk are exactly 0, where a plain relative error would divide rounding noise by 0."""
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def window_sink_case(rank, world, layout, heads, kv_heads, u, window, with_sinks, packed, kernel, seed=0, batch=2):
    """UPipe with ``window`` / sinks (and packed rows) vs ``masked_reference``, float64: relative errors of
    the output, dq, dk, dv and (summed over the ranks, each holding its heads' share) the sinks' gradient."""
    seq = 6 * world
    q, k, v, dout = make_inputs(seed, batch, seq, heads, kv_heads, 8, torch.float64)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    rows = [packed_documents(seq, world, seed + r) for r in range(batch)] if packed else None
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_sinks = sinks.clone().requires_grad_(True) if with_sinks else None
    ref_out = masked_reference(*full, window, ref_sinks, rows)
    ref_out.backward(dout)
    locals_ = [local_shard(t, rank, world, layout).requires_grad_(True) for t in (q, k, v)]
    my_sinks = torch.nn.Parameter(sinks.clone()) if with_sinks else None
    attn = UPipeDistributedAttention(kernel, dist.group.WORLD, head_chunk_size=u, window=window)
    out = attn(*locals_, layout, cu_seqlens=rows, sinks=my_sinks)
    out.backward(local_shard(dout, rank, world, layout))
    errors = {"out": _error(out, local_shard(ref_out.detach(), rank, world, layout))}
    for name, loc, ref in zip("qkv", locals_, full):
        errors[f"d{name}"] = _error(loc.grad, local_shard(ref.grad, rank, world, layout))
    if with_sinks:
        total = my_sinks.grad.clone()
        dist.all_reduce(total)
        errors["dsinks"] = _error(total, ref_sinks.grad)
    return errors


def window_sink_matrix(rank, world):
    """Windows smaller than, equal to and larger than a shard (6 tokens), crossing shard boundaries, and
    covering the whole sequence; with and without sinks; GQA and KV < C; U in {C, H}; both layouts; both
    banded paths (the band mask on the math kernel in tiles of 4 queries, torch's ops in tiles of 3, so
    tiles cross shards too); packed rows."""
    from ds_upipe.windows import SlidingWindowKernel

    failures, count = [], 0
    seq = 6 * world
    # (window, sinks): below a shard, equal to it, crossing shard boundaries, beyond the sequence
    windows = ((1, False), (4, True), (6, False), (6, True), (9, True), (seq + 5, False))
    for (name, (h, hkv)), u_factor, (window, with_sinks) in itertools.product(
        (("gqa4", HEAD_CONFIGS["gqa4"]), ("kv_lt_c", HEAD_CONFIGS["kv_lt_c"])), (1, None), windows
    ):
        u = h if u_factor is None else u_factor * world
        layout = count % 2
        # sdpa as given (``windowed``: the band mask below W = 9, torch's ops from there), the band mask on the
        # math kernel, and torch's ops in tiles of 3 queries (every tile kind, the clipped first ones included)
        kernel = (
            TorchSDPAKernel(),
            SlidingWindowKernel(MathKernel(), window, tile=4),
            SlidingWindowKernel(TorchSDPAKernel(), window, tile=3, fused=window >= 2),
        )[count % 3]
        errs = window_sink_case(rank, world, layout, h, hkv, u, window, with_sinks, False, kernel, seed=count)
        count += 1
        if max(errs.values()) > 1e-10:
            failures.append((name, u, window, with_sinks, layout, errs))
    for (name, (h, hkv)), window, with_sinks in itertools.product(
        (("gqa4", HEAD_CONFIGS["gqa4"]), ("kv_lt_c", HEAD_CONFIGS["kv_lt_c"])), (3, 8), (False, True)
    ):
        kernel = SlidingWindowKernel(TorchSDPAKernel(), window, tile=3, fused=True) if with_sinks else TorchSDPAKernel()
        errs = window_sink_case(rank, world, 0, h, hkv, world, window, with_sinks, True, kernel, seed=count)
        count += 1
        if max(errs.values()) > 1e-10:
            failures.append(("packed", name, window, with_sinks, errs))
    # sinks alone (no window), and the mutations the matrix must catch: an off-by-one window and the sinks
    # of other heads give a reference that differs from the right one by far more than the tolerance
    errs = window_sink_case(rank, world, 1, 16, 4, 2 * world, None, True, False, TorchSDPAKernel(), seed=count)
    count += 1
    if max(errs.values()) > 1e-10:
        failures.append(("sinks only", errs))
    q, k, v, _ = make_inputs(0, 1, seq, 16, 4, 8, torch.float64)
    sinks = torch.randn(16, dtype=torch.float64)
    right = masked_reference(q, k, v, 6, sinks)
    sensitivity = {
        "window+1": relative_error(masked_reference(q, k, v, 7, sinks), right),
        "window-1": relative_error(masked_reference(q, k, v, 5, sinks), right),
        "sinks rolled": relative_error(masked_reference(q, k, v, 6, sinks.roll(1)), right),
    }
    return failures, count, sensitivity


def window_sink_errors(rank, world):
    """Bad windows and sinks raise the same ValueError on every rank (a barrier follows every case)."""

    def attempt(window=None, sinks=None, kernel=None, heads=16, construct_window=None):
        try:
            attn = UPipeDistributedAttention(kernel or TorchSDPAKernel(), dist.group.WORLD, window=construct_window)
            q = torch.randn(2, 6, heads, 8, requires_grad=True)
            k, v = (torch.randn(2, 6, 4, 8, requires_grad=True) for _ in range(2))
            attn(q, k, v, 0, window=window, sinks=sinks).sum().backward()
            result = "no error"
        except ValueError as err:
            result = str(err)
        dist.barrier()
        return result

    def generic(q, k, v, *args, **kwargs):
        return reference_attention(q, k, v, True)

    return {
        "window_zero": attempt(window=0),
        "window_negative_in_constructor": attempt(construct_window=-3),
        "window_bool": attempt(window=True),
        "window_differs": attempt(window=4 + rank),
        "window_non_causal": attempt(window=4, kernel=TorchSDPAKernel(causal=False)),
        "window_generic": attempt(window=4, kernel=generic),
        "sinks_wrong_length": attempt(sinks=torch.zeros(8)),
        "sinks_2d": attempt(sinks=torch.zeros(16, 1)),
        "sinks_int": attempt(sinks=torch.zeros(16, dtype=torch.long)),
        "sinks_on_one_rank": attempt(sinks=torch.zeros(16) if rank == 0 else None),
        "sinks_generic": attempt(sinks=torch.zeros(16), kernel=generic),
        "ok_after_errors": attempt(window=4, sinks=torch.zeros(16)),
    }
