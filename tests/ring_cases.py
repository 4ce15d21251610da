"""Rank-side bodies of the UPipe x Ring tests (importable by spawned processes)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ds_upipe import MathKernel, TorchSDPAKernel, UPipeDistributedAttention
from ds_upipe.ring import RingAttentionKernel, SequenceLayout, build_sequence_groups, zigzag_shard
from tests.core_cases import make_inputs, reference_attention, relative_error

HEAD_DIM = 4
HEADS = 8
#: per-rank sequence shard for each (C_u, R): tiny, with zigzag chunks of several tokens
SHARD = {(2, 2): 5, (4, 2): 3, (1, 4): 6, (4, 1): 6}


def head_configs(ulysses_size: int) -> dict[str, tuple[int, int]]:
    """MHA, GQA with KV >= C_u, and fewer KV heads than C_u (replicated KV) where C_u allows it."""
    configs = {"mha": (HEADS, HEADS), "gqa": (HEADS, max(ulysses_size, 2))}
    if ulysses_size > 1:
        configs["kv_lt_cu"] = (HEADS, ulysses_size // 2)
    return configs


def chunk_sizes(ulysses_size: int) -> list[int]:
    """U in {C_u, 2 C_u, H} (deduplicated)."""
    return sorted({ulysses_size, 2 * ulysses_size, HEADS})


class Groups:
    """This rank's groups for one C_u x R layout of the world (built once per process and layout)."""

    _built: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}

    def __init__(self, ulysses_size: int, ring_size: int) -> None:
        self.layout = SequenceLayout(ulysses_size, ring_size)
        key = (ulysses_size, ring_size)
        if key not in self._built:
            self._built[key] = build_sequence_groups(ulysses_size * ring_size, ring_size)
        self.ulysses, self.ring = self._built[key]
        self.sp_rank = dist.get_rank()

    def shard(self, t: torch.Tensor, batch_dim_idx: int) -> torch.Tensor:
        """This rank's zigzag shard of a [b, S, h, d] tensor, in the requested layout, contiguous."""
        s = zigzag_shard(t, 1, self.layout, self.sp_rank)
        return (s.transpose(0, 1) if batch_dim_idx == 1 else s).contiguous()


def rotary_tables(seq: int, batch_dim_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) over the global sequence in DeepSpeed's rotary_pos_emb layout for ``batch_dim_idx``
    ([S, 1, 1, d] for 0, [1, S, 1, d] for 1: DistributedAttention permutes dims 0 and 1), with an angle
    per position and channel, so a shard given another position's angles shows in the output."""
    angles = torch.randn(seq, HEAD_DIM, generator=torch.Generator().manual_seed(seq), dtype=torch.float64)
    cos, sin = (f(angles)[:, None, None, :] for f in (torch.cos, torch.sin))
    return (cos, sin) if batch_dim_idx == 0 else (cos.transpose(0, 1), sin.transpose(0, 1))


def run_case(
    groups, heads, kv_heads, u, batch_dim_idx, causal, overlap, dtype=torch.float64, kernel=None, batch=2, rotary=False
):
    """UPipe x Ring on zigzag shards vs single-process attention on the whole sequence: relative errors.
    ``rotary``: RoPE tables of the global sequence go to the layer, which applies each shard's positions."""
    from deepspeed.sequence.layer import apply_rotary_pos_emb

    seq = SHARD[(groups.layout.ulysses_size, groups.layout.ring_size)] * groups.layout.sp_size
    q, k, v, dout = make_inputs(u + heads + kv_heads, batch, seq, heads, kv_heads, HEAD_DIM, dtype)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    tables = rotary_tables(seq, batch_dim_idx) if rotary else None
    if rotary:  # [b, S, h, d] reference: position p of every head rotated by table row p
        rows = [t.reshape(seq, 1, 1, HEAD_DIM).transpose(0, 1) for t in rotary_tables(seq, 0)]
        ref = reference_attention(*(apply_rotary_pos_emb(t, *rows) for t in full[:2]), full[2], causal)
    else:
        ref = reference_attention(*full, causal)
    ref.backward(dout)
    local = [groups.shard(t, batch_dim_idx).to(dtype).requires_grad_(True) for t in (q, k, v)]
    attn = UPipeDistributedAttention(
        kernel or TorchSDPAKernel(causal=causal),
        groups.ulysses,
        head_chunk_size=u,
        overlap_comm=overlap,
        ring_group=groups.ring,
    )
    out = attn(*local, batch_dim_idx, tables)
    out.backward(groups.shard(dout, batch_dim_idx).to(dtype))
    errors = {"out": relative_error(out, groups.shard(ref.detach(), batch_dim_idx))}
    for name, loc, glob in zip("qkv", local, full):
        errors[f"d{name}"] = relative_error(loc.grad, groups.shard(glob.grad, batch_dim_idx))
    return errors


def parity_matrix(rank, world, layouts):
    """For each (C_u, R) layout: float64 parity, causal over heads x U x batch_dim_idx x overlap, unmasked
    over heads x U; then the math kernel inside the ring and float32/bfloat16 SDPA.  Returns
    {layout: (failures, count)}."""
    results = {}
    for cu, r in layouts:
        groups = Groups(cu, r)
        failures, count = [], 0
        # causal: every combination; unmasked: one layout and overlap per head config and U
        cases = [
            (*c, True) for c in itertools.product(head_configs(cu).items(), chunk_sizes(cu), (0, 1), (False, True))
        ]
        cases += [(c, u, 1, True, False) for c, u in itertools.product(head_configs(cu).items(), chunk_sizes(cu))]
        for (name, (h, hkv)), u, layout, overlap, causal in cases:
            errs = run_case(groups, h, hkv, u, layout, causal, overlap)
            count += 1
            if max(errs.values()) > 1e-10:
                failures.append((name, u, layout, overlap, causal, errs))
        for layout in (0, 1):
            h, hkv = head_configs(cu)["gqa"]
            errs = run_case(groups, h, hkv, cu, layout, True, False, rotary=True)
            count += 1
            if max(errs.values()) > 1e-10:
                failures.append(("rotary", layout, errs))
        for label, kernel, dtype, tol in (
            ("math", MathKernel(causal=True), torch.float64, 1e-10),
            ("sdpa fp32", TorchSDPAKernel(causal=True), torch.float32, 1e-5),
            ("sdpa bf16", TorchSDPAKernel(causal=True), torch.bfloat16, 3e-2),
        ):
            h, hkv = head_configs(cu)["gqa"]
            errs = run_case(groups, h, hkv, cu, 0, True, True, dtype=dtype, kernel=kernel)
            count += 1
            if max(errs.values()) > tol:
                failures.append((label, errs))
        results[(cu, r)] = (failures, count)
    return results


def load_balance(rank, world, layouts, batch=1, shard=8):
    """Query-key products each rank's ring kernel kept (forward + backward, causal), per layout."""
    out = {}
    for cu, r in layouts:
        groups = Groups(cu, r)
        seq = shard * cu * r
        q, k, v, dout = make_inputs(0, batch, seq, HEADS, HEADS // 2, HEAD_DIM, torch.float64)
        local = [groups.shard(t, 0).requires_grad_(True) for t in (q, k, v)]
        attn = UPipeDistributedAttention(TorchSDPAKernel(causal=True), groups.ulysses, ring_group=groups.ring)
        attn(*local, 0).backward(groups.shard(dout, 0))
        kernel = attn.attention_kernel()
        assert isinstance(kernel, RingAttentionKernel)
        out[(cu, r)] = (dist.get_rank(groups.ring), kernel.work[0], seq)
    return out


def cuda_adapter_parity(rank, world):
    """Ring attention around TorchSDPAKernel's CUDA paths (flash for bf16, memory-efficient for fp32),
    run on CPU through test_kernel_contracts' CPU implementations of the CUDA ops: the efficient op's
    lse comes padded to 32 rows with NaN, so a ring that merged or passed back the padding would show."""
    from ds_upipe.kernels import torch_sdpa
    from tests import test_kernel_contracts as contracts

    rec = contracts.Recorder()
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", contracts._flash_forward(rec), "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", contracts._flash_backward(rec), "CPU")
    lib.impl("_scaled_dot_product_efficient_attention", contracts._efficient_forward(rec), "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", contracts._efficient_backward(rec), "CPU")
    original = torch_sdpa.sdpa_path
    torch_sdpa.sdpa_path = lambda device_type, dtype, *dims: original("cuda", dtype, *dims)
    try:
        groups = Groups(2, 2)
        errors = {}
        for dtype, overlap in itertools.product((torch.float32, torch.bfloat16), (False, True)):
            errors[(str(dtype), overlap)] = run_case(groups, 8, 2, 2, 0, True, overlap, dtype=dtype)
        calls = sorted({name for name, *_ in rec.calls})
    finally:
        torch_sdpa.sdpa_path = original
        lib._destroy()
    return errors, calls


def memory_by_layout(rank, world, layouts, seq=512, heads=16, kv_heads=4, head_dim=64):
    """Per-rank peak and intermediate bytes (MemTracker) of UPipe x Ring at U = C_u, 2 C_u and H, for the
    same global sequence on every layout, float32, causal."""
    from ds_upipe.tools.memory import measure_attention

    out = {}
    for cu, r in layouts:
        groups = Groups(cu, r)
        q, k, v, dout = make_inputs(rank, 1, seq, heads, kv_heads, head_dim, torch.float32)
        local = [groups.shard(t, 0).float().requires_grad_(True) for t in (q, k, v)]
        for u in sorted({cu, 2 * cu, heads}):
            attn = UPipeDistributedAttention(
                TorchSDPAKernel(causal=True), groups.ulysses, head_chunk_size=u, ring_group=groups.ring
            )
            m = measure_attention(attn, *local, groups.shard(dout, 0).float(), 0)
            out[(cu, r, u)] = (m.intermediate_bytes, m.peak_bytes)
    return out


def bad_layout_errors(rank, world):
    """Each bad layout raises ValueError with one message on every rank (world 4) and leaves no rank
    blocked (a barrier follows every case)."""
    from ds_upipe.ring import sequence_group_ranks

    def attempt(fn):
        try:
            fn()
            result = "no error"
        except ValueError as err:
            result = str(err)
        dist.barrier()
        return result

    two_by_two = Groups(2, 2)
    ring_only = Groups(1, 4)

    def attend(groups, seq=4, heads=8, kv=2, u=None, kernel=None, cu_seqlens=None, value_dim=4, **kwargs):
        def run():
            attn = UPipeDistributedAttention(
                kernel or TorchSDPAKernel(), groups.ulysses, head_chunk_size=u, ring_group=groups.ring, **kwargs
            )
            q, k, v = (torch.randn(2, seq, n, d, requires_grad=True) for n, d in ((heads, 4), (kv, 4), (kv, value_dim)))
            attn(q, k, v, 0, cu_seqlens=cu_seqlens).sum().backward()

        return attempt(run)

    def generic(q, k, v, *args, **kwargs):
        return reference_attention(q, k, v, True)

    ring_index = dist.get_rank(two_by_two.ring)
    return {
        "ring_not_dividing_sp": attempt(lambda: build_sequence_groups(6, 4)),
        "world_not_multiple_of_sp": attempt(lambda: sequence_group_ranks(world, 8, 2)),
        "ring_size_zero": attempt(lambda: sequence_group_ranks(world, 4, 0)),
        "heads_not_divisible_by_cu": attend(two_by_two, heads=3, kv=3),
        "kv_incompatible_with_cu": attend(two_by_two, heads=6, kv=3),
        "u_invalid_for_cu": attend(two_by_two, u=3),
        "odd_ring_block": attend(ring_only, seq=3),
        "uneven_shards_on_one_ring_rank": attend(two_by_two, seq=4 + 2 * ring_index),
        "generic_callable_with_ring": attend(two_by_two, kernel=generic),
        "ring_overlap_differs": attend(two_by_two, ring_overlap=rank == 3),
        "packed_with_ring": attend(two_by_two, cu_seqlens=[0, 5, 16]),
        "latent_value_with_ring": attend(two_by_two, value_dim=2),
        "ok_after_errors": attend(two_by_two),
    }


def bench_with_ring(rank, world):
    """``ds-upipe bench --ring-size 2`` on this world of 4 (Ulysses 2 x ring 2), 512 tokens with an MLP of
    intermediate size 64: every core and layer case of ``BenchSpec(ring_size=2)`` run by the bench's own
    case runners (memory only), with each case's max abs difference to the level's baseline (U = H:
    Ulysses x Ring).  The shape puts the fused/unfused layer's peak inside the attention, where U acts:
    at 64 tokens it is set outside the attention (the same at every U); at 256 tokens with the default
    MLP (2 x hidden) the fused U = H peak is o_proj/q_proj weight-gradient temporaries (hidden^2, the same
    at every U), within 1.5% of U = 2's; at 512 tokens with the default MLP, the MLP sets it."""
    from ds_upipe.tools import bench

    spec = bench.BenchSpec(
        world=world,
        ring_size=2,
        seq_lens=[512],
        heads=8,
        kv_heads=2,
        head_dim=16,
        intermediate=64,
        head_chunk_sizes=[2, 8],
        repeats=0,
    )
    out = {}
    for level, runner in (("core", bench.run_core_case), ("layer", bench.run_layer_case)):
        reference = None
        for method in spec.methods(level):
            res = runner(method, spec, 512, rank, torch.device("cpu"))
            reference = reference or res["values"]
            out[method.name] = (res["intermediate"], bench._max_abs_diff(res["values"], reference))
    return out


def world_suite(
    rank, world, parity_layouts, memory_layouts=(), errors=False, cuda_adapters=False, hf_compact_layouts=()
):
    """Everything one spawn of ``world`` ranks checks: parity and load balance on ``parity_layouts``,
    then optionally memory, bad-layout errors, the CUDA adapters' stand-ins, and the patched HF models'
    compact ring case set (``tests.hf_cases.ring_cases_compact``) on ``hf_compact_layouts``."""
    out = {"parity": parity_matrix(rank, world, parity_layouts), "balance": load_balance(rank, world, parity_layouts)}
    if (2, 2) in parity_layouts:
        out["windows"] = window_sink_ring_matrix(rank, world)
    if hf_compact_layouts:
        from tests import hf_cases

        out["hf"] = hf_cases.ring_suite(rank, world, hf_compact_layouts, True)
    if memory_layouts:
        out["memory"] = memory_by_layout(rank, world, memory_layouts)
    if errors:
        out["errors"] = bad_layout_errors(rank, world)
    if cuda_adapters:
        out["cuda_adapters"] = cuda_adapter_parity(rank, world)
        out["bench"] = bench_with_ring(rank, world)
    return out


def window_sink_ring_case(groups, heads, kv_heads, u, window, with_sinks, batch_dim_idx, seed=0):
    """UPipe x Ring with a sliding window and/or sinks on zigzag shards vs ``core_cases.masked_reference``
    on the whole sequence, float64: errors of out, dq, dk, dv, the sinks' gradient (summed over all ranks),
    and the query-key products the ring kernel computed (forward + backward)."""
    from tests.core_cases import _error, masked_reference

    seq = SHARD[(groups.layout.ulysses_size, groups.layout.ring_size)] * groups.layout.sp_size
    q, k, v, dout = make_inputs(seed, 2, seq, heads, kv_heads, HEAD_DIM, torch.float64)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_sinks = sinks.clone().requires_grad_(True) if with_sinks else None
    ref = masked_reference(*full, window, ref_sinks)
    ref.backward(dout)
    local = [groups.shard(t, batch_dim_idx).requires_grad_(True) for t in (q, k, v)]
    my_sinks = torch.nn.Parameter(sinks.clone()) if with_sinks else None
    attn = UPipeDistributedAttention(
        TorchSDPAKernel(), groups.ulysses, head_chunk_size=u, ring_group=groups.ring, window=window
    )
    out = attn(*local, batch_dim_idx, sinks=my_sinks)
    out.backward(groups.shard(dout, batch_dim_idx))
    errors = {"out": _error(out, groups.shard(ref.detach(), batch_dim_idx))}
    for name, loc, glob in zip("qkv", local, full):
        errors[f"d{name}"] = _error(loc.grad, groups.shard(glob.grad, batch_dim_idx))
    if with_sinks:
        total = my_sinks.grad.clone()
        dist.all_reduce(total)
        errors["dsinks"] = _error(total, ref_sinks.grad)
    ring = attn.attention_kernel(window=window)
    return errors, ring.work[0]


def window_sink_ring_matrix(rank, world, layout=(2, 2)):
    """Windows below, equal to and beyond a zigzag chunk (5 tokens at 2 x 2), crossing chunk and ring-block
    boundaries, and beyond the sequence; sinks with and without a window; GQA and KV < C_u, U in {C_u, H}.
    Returns (failures, count, {window: products computed}) with the products of full causal as None."""
    groups = Groups(*layout)
    seq = SHARD[layout] * groups.layout.sp_size
    failures, count, work = [], 0, {}
    cases = ((1, False), (3, True), (5, False), (7, True), (12, False), (seq + 3, True), (None, True))
    for (name, (h, hkv)), u, (window, with_sinks) in itertools.product(
        (("gqa", head_configs(layout[0])["gqa"]), ("kv_lt_cu", head_configs(layout[0])["kv_lt_cu"])),
        (layout[0], HEADS),
        cases,
    ):
        errs, products = window_sink_ring_case(groups, h, hkv, u, window, with_sinks, count % 2, seed=count)
        count += 1
        if (name, u) == ("gqa", HEADS):
            work[window] = products
        if max(errs.values()) > 1e-10:
            failures.append((name, u, window, with_sinks, errs))
    return failures, count, work
