"""Searches and reports: the largest context that fits, what binds it, the tables, the JSON."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from .memory import (
    HOST_BASIS,
    RESERVE_BASIS,
    group_recompute_fraction,
    host_terms,
    images_per_rank,
    kept_checkpoints,
    model_state_bytes,
    offloaded_below_top,
    predict,
    ranks_per_node,
    zero_buffer_bytes,
)
from .models import ModelDims
from .setup import AttentionScheme, TrainSetup, methods_for
from .units import PAPER_STEPS, GiB

if TYPE_CHECKING:
    pass

# -- searches and reports --------------------------------------------------------------------------


def max_context(
    dims: ModelDims, setup: TrainSetup, method: AttentionScheme, granularity: int = 2**14, limit: int = 2**27
) -> int:
    """The largest sequence length, a multiple of ``granularity`` (and of the GPU count), that fits
    BOTH the GPU (``predict``) and the node's host memory (``host_terms``); 0 when not even one step
    fits (``nothing_fits`` says why).  Every candidate is a fake run; the memory is nearly affine in
    the length, so secant guesses land next to the answer, each checked with its neighbour, and
    what remains of the bracket is closed by bisection."""
    step = math.lcm(granularity, setup.seq_multiple)
    # the host memory is analytic and grows with the length: cap the search where it stops fitting
    top = host_max_context(dims, setup, granularity, limit) // step
    if not top:
        return 0
    budget = setup.gpu_memory_gib
    totals: dict[int, float] = {}

    def fits(k: int) -> bool:
        if k not in totals:
            totals[k] = predict(dims, setup, method, k * step).total_gib
        return totals[k] <= budget

    if not fits(1):
        return 0
    lo, hi = 1, None  # fits(lo); not fits(hi)
    points = [1, min(top, max(2, 2**20 // step))]  # 1 and ~1M tokens: two runs for the first secant
    for _ in range(4):
        for k in points:
            if fits(k):
                lo = max(lo, k)
            else:
                hi = k if hi is None else min(hi, k)
        if lo == top or (hi is not None and hi - lo <= 1):
            break
        (a, b) = sorted(totals)[-2:] if hi is None else (lo, hi)
        slope = (totals[b] - totals[a]) / (b - a)
        guess = top if slope <= 0 else int(a + (budget - totals[a]) / slope)
        guess = min(max(guess, lo + 1), top if hi is None else hi - 1)
        points = [guess, guess + 1] if guess < top else [guess]
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def host_max_context(dims: ModelDims, setup: TrainSetup, granularity: int = 2**14, limit: int = 2**27) -> int:
    """The largest length (a multiple of ``context_step``, at most ``limit``) whose host terms fit the node's
    host memory (analytic, by bisection; 0 if none)."""
    step = math.lcm(granularity, setup.seq_multiple)
    budget = setup.host_memory_gib * GiB

    def fits(k: int) -> bool:
        return sum(host_terms(dims, setup, k * step).values()) <= budget

    lo, hi = 0, max(1, limit // step) + 1  # fits(lo) (0: nothing), not fits(hi)
    if fits(hi - 1):
        return (hi - 1) * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * step


def context_step(setup: TrainSetup, granularity: int = 2**14) -> int:
    return math.lcm(granularity, setup.seq_multiple)


def binding_limit(
    dims: ModelDims, setup: TrainSetup, method: AttentionScheme, max_len: int, granularity: int = 2**14
) -> str:
    """What stops the next length after ``max_len``: "GPU", "host" or "both"."""
    nxt = max_len + context_step(setup, granularity)
    gpu_over = predict(dims, setup, method, nxt).total_gib > setup.gpu_memory_gib
    host_over = sum(host_terms(dims, setup, nxt).values()) > setup.host_memory_gib * GiB
    return "both" if gpu_over and host_over else "host" if host_over else "GPU"


def nothing_fits(dims: ModelDims, setup: TrainSetup, method: AttentionScheme) -> str:
    """Why not even the smallest length fits: the binding memory and its largest terms."""
    n = context_step(setup)
    p = predict(dims, setup, method, n)
    parts = []
    if not p.gpu_fits:
        gpu = {
            "model states": p.model_states_gib,
            "ZeRO buffers": p.zero_buffers_gib,
            "reserve": p.reserve_gib,
            "the other layers": p.other_layers_gib,
            f"{p.peak_phase} phase": p.phase_gib,
        }
        top = max(gpu, key=lambda k: gpu[k])
        parts.append(
            f"GPU: {p.total_gib:.1f} GiB > --gpu-memory {setup.gpu_memory_gib:g} GiB at {fmt_tokens(n)} tokens, "
            f"largest term {top} {gpu[top]:.1f} GiB"
        )
    if not p.host_fits:
        top = max(p.host_terms_gib, key=lambda k: p.host_terms_gib[k])
        parts.append(
            f"host: {p.host_gib:.1f} GiB > --host-memory {setup.host_memory_gib:g} GiB per node at "
            f"{fmt_tokens(n)} tokens, largest term {top} {p.host_terms_gib[top]:.1f} GiB"
        )
    return f"{p.method}: nothing fits; " + "; ".join(parts)


def which_head_chunk_report(
    dims: ModelDims, setup: TrainSetup, seq_len: int, methods: Sequence[AttentionScheme] | None = None
) -> str:
    """Answer "which U do I need for N tokens": every method at N (``methods``, as the plan table runs
    them; default ``methods_for``), then the recommendation (the largest U that fits: fewest stages,
    closest to Ulysses' speed)."""
    methods = list(methods) if methods is not None else methods_for(dims, setup.gpus, ring_size=setup.ring_size)
    preds = [predict(dims, setup, m, seq_len) for m in methods]
    ring = f" (Ulysses {setup.ulysses_size} x ring {setup.ring_size})" if setup.ring_size > 1 else ""
    lines = [f"at {fmt_tokens(seq_len)} tokens on {setup.gpus} x {setup.gpu_memory_gib:g} GiB{ring}:"]
    for p in preds:
        lines.append(f"  {p.method:<22}{p.total_gib:>8.1f} GiB  {'fits' if p.fits else 'does not fit'}")
    upipe_fit = [(p, m) for p, m in zip(preds, methods) if m.kind == "upipe" and p.fits]
    if methods[0].kind == "ulysses" and preds[0].fits:
        lines.append("-> Ulysses (ALST) already fits; UPipe is not needed at this length.")
    elif upipe_fit:
        best = max(upipe_fit, key=lambda pm: pm[1].options.head_chunk_size or 0)[0]
        lines.append(f"-> use {best.method}: the largest head chunk that fits (fewest stages).")
    else:
        lines.append("-> nothing fits at this length. Add GPUs, offload more, or shorten the sequence.")
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


def moe_basis(dims: ModelDims) -> str:
    """How an MoE model (and a windowed one) is planned, for the reports ("" for a dense full-causal one)."""
    notes = []
    if dims.num_experts:
        notes.append(
            f"MoE: {dims.num_experts} experts of {dims.intermediate_size}, top-{dims.experts_per_token}; all experts "
            "in the model states and ZeRO-3's gathered layer; the fake run's MLP is a dense stand-in of width "
            f"{dims.mlp_stand_in_intermediate} (top-k x (expert intermediate + 3/4 hidden): one token's activations "
            "in its experts)"
        )
    if dims.mixer is not None:
        m = dims.mixer
        counts = ", ".join(f"{n} {kind}" for kind, n in dims.layer_counts.items())
        notes.append(
            f"hybrid: {counts} layers, each kind's two-layer step run (the peak is the largest kind's); {m.kind} mixer "
            f"of {m.num_heads} heads on {m.num_groups} groups, head dim {m.head_dim}; transformers' torch fallback "
            "of the recurrence and conv (FLA / mamba_ssm / causal-conv1d are GPU kernels with other intermediates)"
        )
    if dims.sliding_window:
        notes.append(f"sliding-window layers ({dims.sliding_window} tokens) planned as full causal (an upper bound)")
    if dims.attention_sinks:
        notes.append("attention sinks: one logit per head, no activation term")
    return "; ".join(notes)


def vision_note(dims: ModelDims, setup: TrainSetup) -> str:
    """How a vision-language model is planned: its text model, the vision tokens as sequence tokens, and what the
    tower adds per rank with the images shared out (``memory.vision_terms``; docs/vlm.md)."""
    per_rank = images_per_rank(setup)
    tower = (
        f"{per_rank} x {setup.tower_bytes_per_image / 2**20:.1f} MiB of tower activations a rank (given per image)"
        if setup.tower_bytes_per_image
        else "the tower's activations are not planned (give --tower-mib-per-image, measured: docs/vlm.md)"
    )
    return (
        f"vision-language model ({dims.vision_model_type}): its text model is planned, the vision tower and projector "
        f"({dims.vision_params / 1e9:.3f}B params) are in the model states.  Vision tokens are sequence tokens (merged "
        f"into the sequence): each length counts the {setup.vision_tokens} vision tokens of a sample.  Every rank "
        f"merges the whole sample (held while the text model's forward runs; its gathered vision features through the "
        f"step); the "
        f"{setup.images} images a sample are shared out over {setup.gpus} ranks, at most {per_rank} a rank: {tower}"
    )


def describe(dims: ModelDims, setup: TrainSetup) -> str:
    moe = (
        f", {dims.num_experts} experts top-{dims.experts_per_token}"
        + ("" if dims.is_hybrid else f", {dims.active_params_per_token / 1e9:.2f}B active")
        if dims.num_experts
        else ""
    )
    basis = moe_basis(dims)
    return (
        f"{dims.name}: H={dims.num_heads} KV={dims.num_kv_heads} d={dims.head_dim} hidden={dims.hidden_size} "
        f"intermediate={dims.intermediate_size} layers={dims.num_layers} vocab={dims.vocab_size} "
        f"({dims.total_params / 1e9:.2f}B params{moe})\n"
        + (f"{basis}\n" if basis else "")
        + (f"{vision_note(dims, setup)}\n" if dims.vision_model_type else "")
        + f"{setup.gpus} GPUs x {setup.gpu_memory_gib:g} GiB"
        + (f" (Ulysses {setup.ulysses_size} x ring {setup.ring_size})" if setup.ring_size > 1 else "")
        + f", ZeRO-{setup.zero_stage}, {setup.dtype}, "
        f"checkpointing={setup.checkpointing} (CPU offload={setup.offload_checkpoints}"
        + (
            f", {setup.checkpoint_groups} checkpoint groups of k={setup.checkpoint_group_size}"
            if setup.checkpoint_groups
            else ""
        )
        + f"), {setup.stack_label}, "
        f"kernel workspace={setup.kernel}, micro-batch={setup.batch}, GPU reserve={setup.reserve_gib:g} GiB\n"
        f"host {setup.host_memory_gib:g} GiB per node (host reserve {setup.host_os_gib:g} + "
        f"{setup.host_per_rank_gib:g}/rank GiB), offload_optimizer={setup.offload_optimizer}, "
        f"offload_param={setup.offload_param}, checkpoint pinning={setup.checkpoint_pinning}"
    )


def plan_table(dims: ModelDims, setup: TrainSetup, seq_lens: Iterable[int], methods: list[AttentionScheme]) -> str:
    """Predicted peak GiB per method and length (* = does not fit) and each method's max context."""
    seq_lens = list(seq_lens)
    head = (
        f"{'method':<22}"
        + "".join(f"{fmt_tokens(s):>9}" for s in seq_lens)
        + f"{'max context':>13}{'grid':>7}{'binds':>7}"
    )
    lines = [
        describe(dims, setup),
        "predicted peak GiB per GPU (* = does not fit the GPU; + = does not fit the host)",
        head,
        "-" * len(head),
    ]
    for m in methods:
        cells = []
        for s in seq_lens:
            p = predict(dims, setup, m, s)
            cells.append(f"{p.total_gib:>8.1f}{'+' if not p.host_fits else ' ' if p.gpu_fits else '*'}")
        mc = max_context(dims, setup, m)
        binds = binding_limit(dims, setup, m, mc) if mc else "-"
        lines.append(f"{m.label:<22}" + "".join(cells) + f"{fmt_tokens(mc):>13}{paper_step(mc):>7}{binds:>7}")
    host_row = [sum(host_terms(dims, setup, s).values()) / GiB for s in seq_lens]
    lines.append(f"{'host GiB per node':<22}" + "".join(f"{h:>8.0f} " for h in host_row))
    states = model_state_bytes(dims, setup) / GiB
    zero = zero_buffer_bytes(dims, setup) / GiB
    lines.append(
        f"fixed per GPU: model states {states:.1f} GiB, ZeRO buffers {zero:.1f} GiB, "
        f"reserve {setup.reserve_gib:g} GiB; 'grid' = the largest of the paper's lengths (128K ... 5M) that fits; "
        f"host: {setup.host_memory_gib:g} GiB per node of {ranks_per_node(setup)} ranks, 'binds' = what stops "
        "the next length"
    )
    return "\n".join(lines)


def breakdown_report(dims: ModelDims, setup: TrainSetup, method: AttentionScheme, seq_len: int) -> str:
    """The components of the predicted peak at ``seq_len`` and the allocation that sets it."""
    p = predict(dims, setup, method, seq_len, live=True)
    lines = [
        f"breakdown: {p.method} at {fmt_tokens(seq_len)} tokens ({p.total_gib:.2f} GiB of "
        f"{setup.gpu_memory_gib:g}, {'fits' if p.fits else 'does not fit'})",
        *([f"  model basis: {moe_basis(dims)}"] if moe_basis(dims) else []),
        f"  model states (ZeRO-{setup.zero_stage}, analytic)        {p.model_states_gib:8.2f} GiB",
        f"  ZeRO buffers (analytic)                  {p.zero_buffers_gib:8.2f} GiB",
        f"  reserve (assumed: {RESERVE_BASIS})",
        f"                                           {p.reserve_gib:8.2f} GiB",
        f"  {p.peak_phase} phase of a two-layer step, fake-tensor run   {p.phase_gib:8.2f} GiB"
        + (f"  (of which kernel workspace {p.workspace_gib:.2f}, analytic)" if p.workspace_gib else ""),
        f"  the other {max(0, dims.num_layers - 2)} layers in that phase (analytic)   {p.other_layers_gib:8.2f} GiB"
        f"  ({p.other_layers_basis})",
        *(
            [f"  offloaded in that phase (analytic)      {-p.offloaded_gib:8.2f} GiB  ({p.offloaded_basis})"]
            if p.offloaded_gib
            else []
        ),
        *(
            [f"  vision-language model (analytic): {k} {v:.2f} GiB" for k, v in p.vision_gib.items()]
            if p.vision_gib
            else []
        ),
        "  phases (two-layer run + other layers): " + ", ".join(f"{k} {v:.2f} GiB" for k, v in p.phases_gib.items()),
        f"  peak set by: {p.peak_at}",
        "  alive at the peak (by the operation that allocated it):",
    ]
    lines += [f"    {gib:8.2f} GiB  {label}" for label, gib in p.live_at_peak]
    lines.append(
        f"  host memory per node ({ranks_per_node(setup)} ranks): {p.host_gib:.1f} GiB of "
        f"{setup.host_memory_gib:g}, {'fits' if p.host_fits else 'does not fit'}"
    )
    lines += [f"    {gib:8.1f} GiB  {label}" for label, gib in p.host_terms_gib.items()]
    lines.append(f"    (OS and processes: {setup.host_os_gib:g} + {setup.host_per_rank_gib:g}/rank GiB; {HOST_BASIS})")
    if setup.checkpoint_groups:
        groups, k = setup.checkpoint_groups, setup.checkpoint_group_size
        lines.append(
            f"  checkpoint groups: {groups} of k={k} (layers 0-{groups * k - 1}): {groups * (k - 1)} layer inputs/rank "
            f"fewer kept, {k - 2} inner held during a group's backward, {groups * (k - 1)} more layer forwards per "
            f"step, about +{100 * group_recompute_fraction(dims, setup):.1f}% of the layers' compute (estimate: "
            "backward = 2 forwards)"
        )
    return "\n".join(lines)


def grouped(dims: ModelDims, setup: TrainSetup, k: int, groups: int | None = None) -> TrainSetup:
    """``setup`` with the lowest ``groups`` x ``k`` layers in checkpoint groups of ``k`` (default: as many as
    fit; none for k = 1)."""
    n = (dims.num_layers // k if groups is None else groups) if k > 1 else 0
    return replace(setup, checkpoint_groups=n, checkpoint_group_size=max(k, 2))


def group_size_rows(
    dims: ModelDims,
    setup: TrainSetup,
    method: AttentionScheme,
    sizes: Iterable[int] | None = None,
    granularity: int = 2**14,
    limit: int = 2**27,
) -> list[tuple[int, TrainSetup, int, str, float]]:
    """Per group size k (1: no groups; default 1 .. 2 sqrt(L)): (k, the setup with the fewest groups that reach
    the longest context k allows, that max context on both memories, what binds the next length, the extra
    layer compute as a fraction).  Host memory falls as groups are added (``kept_checkpoints``), so the
    fewest groups are found by bisection.  ``limit``: the longest length searched (``max_context``'s)."""
    sizes = list(sizes) if sizes is not None else list(range(1, 2 * math.isqrt(dims.num_layers) + 1))
    # offloaded checkpoints: the groups change the host terms and, on the GPU, only whether the input below
    # the top layer is on the host (``offloaded_below_top``: not once groups reach the top two layers), so
    # the GPU's limit is searched once per answer to that
    gpu_limits: dict[bool, int] = {}

    def gpu_limit(s: TrainSetup) -> int:
        key = bool(offloaded_below_top(dims, s, 0))
        if key not in gpu_limits:
            gpu_limits[key] = max_context(dims, replace(s, host_memory_gib=math.inf), method, granularity, limit)
        return gpu_limits[key]

    def reach(s: TrainSetup) -> int:
        if not setup.offload_checkpoints:
            return max_context(dims, s, method, granularity, limit)
        return min(gpu_limit(s), host_max_context(dims, s, granularity, limit))

    rows = []
    for k in sizes:
        # the most groups, and the most that leave the top two layers out (below which reach grows with groups)
        s = max(
            {grouped(dims, setup, k), grouped(dims, setup, k, (dims.num_layers - 2) // k)},
            key=lambda c: (reach(c), -c.checkpoint_groups),
        )
        mc = reach(s)
        lo, hi = -1, s.checkpoint_groups  # the reach at lo groups < mc <= at hi groups
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if reach(grouped(dims, setup, k, mid)) >= mc else (mid, hi)
        s = grouped(dims, setup, k, hi)
        binds = binding_limit(dims, s, method, mc, granularity) if mc else "-"
        rows.append((k, s, mc, binds, group_recompute_fraction(dims, s)))
    return rows


def choose_group_size(dims: ModelDims, setup: TrainSetup, method: AttentionScheme) -> TrainSetup:
    """The setup with the group size and count that reach the longest context on both memories, the least
    extra compute among those (``group_size_rows``)."""
    best = max(group_size_rows(dims, setup, method), key=lambda r: (r[2], -r[4]))
    return best[1]


def group_size_report(dims: ModelDims, setup: TrainSetup, method: AttentionScheme) -> str:
    """The group-size table: per k the max context, what binds it, and the extra compute."""
    head = f"{'k':>3}{'groups':>8}{'host inputs/rank':>18}{'max context':>13}{'binds':>7}{'extra compute':>15}"
    lines = [
        f"checkpoint groups for {method.label} (per k the fewest groups reaching the longest context; k=1: none)",
        head,
        "-" * len(head),
    ]
    for k, s, mc, binds, extra in group_size_rows(dims, setup, method):
        engine, saved, inner = kept_checkpoints(dims, s) if s.checkpointing else (0, 0, 0)
        kept = engine + saved + inner
        lines.append(f"{k:>3}{s.checkpoint_groups:>8}{kept:>18}{fmt_tokens(mc):>13}{binds:>7}{100 * extra:>14.1f}%")
    return "\n".join(lines)


def to_json(dims: ModelDims, setup: TrainSetup, seq_lens: Iterable[int], methods: list[AttentionScheme]) -> dict:
    out: dict = {"model": asdict(dims), "setup": asdict(setup), "predictions": [], "max_context": {}}
    for m in methods:
        out["max_context"][m.label] = max_context(dims, setup, m)
        out["predictions"].extend(asdict(predict(dims, setup, m, s)) for s in seq_lens)
    return out
