"""``ds-upipe bench --levels ops``: a deterministic count of what one forward+backward step does.

Per method, on rank 0 of C spawned gloo ranks, over one forward+backward step (the same inputs as the
bench's core and layer levels):

- **collectives**: c10d ops dispatched (all-to-all, all_gather, ...), seen by a ``TorchDispatchMode``;
- **copy bytes**: bytes written by copy-like aten ops (``COPY_OPS``: copy_, _to_copy, clone, cat, stack,
  index_select, index, index_copy(_), index_add(_), index_put(_); for the in-place index ops the
  bytes of the source (index_put's values) written, not of the whole destination), as a multiple of the bytes of this
  rank's local q, k, v and attention output (the "x" column);
- **aten ops**: every aten op dispatched (the host's per-op overhead: on a GPU each is a launch or more);
- **host syncs**: ops that read device data on the host (``SYNC_OPS``: .item()/.tolist(), nonzero,
  equal, ...); none of them sync on CPU, but each would stall the host on a GPU;
- **main-thread CPU s** (``--repeats`` > 0, layer level): each rank's median ``time.thread_time()`` of
  its main thread over the step, with no dispatch mode on, averaged over the ranks, and its ratio to
  ALST's measured in the same run, the layer-level methods' steps run round-robin (on CPU the main
  thread also runs the kernels, so this is compute plus host overhead).

The counts do not depend on timing or the machine's load (only the CPU seconds do): a benchmark, run
on demand, never a timed test.  Methods: the core level's DeepSpeed ``DistributedAttention``, ALST's
``UlyssesSPAttentionHF`` and UPipe's core at U = C and U = H; the layer level's ALST decoder layer
and the fused UPipe decoder layer at U = C (and U = H), with and without
``recompute_attention_output``, and at U = C with ``accumulate_dtype: "input"`` (dK/dV per stage).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .bench import BenchSpec, Method

#: aten ops counted as copies (``copy bytes``)
COPY_OPS = frozenset(
    {
        "copy_",
        "_to_copy",
        "clone",
        "cat",
        "stack",
        "index_select",
        "index",
        "index_copy",
        "index_copy_",
        "index_add",
        "index_add_",
        "index_put",
        "index_put_",
        "_unsafe_index",
        "gather",
        "scatter",
        "scatter_",
    }
)
#: in-place index ops whose written bytes are their source's (argument 3), not their whole output
_INDEX_INTO = frozenset({"index_copy_", "index_copy", "index_add_", "index_add"})
#: index_put(_): the bytes of its values (argument 2), not of the whole output
_PUT_INTO = frozenset({"index_put_", "index_put"})
#: aten ops that read device data on the host (each a device sync on a GPU)
SYNC_OPS = frozenset(
    {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique_consecutive", "_unique2"}
)


#: substrings naming a collective in a custom (non-aten, non-c10d) op namespace
_COLLECTIVE_NAMES = ("all_to_all", "all_gather", "all_reduce", "reduce_scatter", "broadcast")


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched on this thread while active (autograd's CPU backward runs on the
    calling thread, so a CPU step's backward is counted too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.collectives: Counter[str] = Counter()
        self.copy_bytes = 0
        self.host_syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns in ("c10d", "_c10d_functional") or (ns != "aten" and any(k in name for k in _COLLECTIVE_NAMES)):
            # DeepSpeed's ``deepspeed::dim_zero_all_to_all`` custom op (Ulysses' all-to-all) counts as
            # one collective; the ops it runs inside are not seen (the mode is off inside an op)
            self.collectives[f"{ns}.{name}"] += 1
        elif ns == "aten":
            self.ops[name] += 1
            if name in COPY_OPS:
                if name in _INDEX_INTO:
                    self.copy_bytes += _bytes(args[3])
                elif name in _PUT_INTO:
                    self.copy_bytes += _bytes(args[2])
                elif isinstance(out, (list, tuple)):
                    self.copy_bytes += sum(_bytes(t) for t in out)
                else:
                    self.copy_bytes += _bytes(out)
            if name in SYNC_OPS:
                self.host_syncs += 1
        return out


@dataclass
class OpCount:
    level: str
    method: str
    seq_len: int
    collectives: int
    collective_kinds: dict[str, int]
    aten_ops: int
    copy_bytes: int
    #: bytes of this rank's local q, k, v and attention output (the copy ratio's unit)
    qkvo_bytes: int
    host_syncs: int
    cpu_s: float = math.nan
    cpu_ratio: float = math.nan  # vs the level's baseline (ALST)
    top_ops: dict[str, int] = field(default_factory=dict)

    @property
    def copy_ratio(self) -> float:
        return self.copy_bytes / self.qkvo_bytes


def count_step(step: Callable[[], Any]) -> OpCounter:
    counter = OpCounter()
    with counter:
        step()
    return counter


def interleaved_cpu_seconds(steps: list[Callable[[], Any]], repeats: int, warmup: int) -> list[float]:
    """Median main-thread CPU time of each of ``steps``, run round-robin (step 0, 1, ..., 0, 1, ...; all
    ranks start each step together): a drift of the machine's load over the run reaches every method
    alike, where timing one method's repeats after another's would charge it to whichever ran then."""
    import torch.distributed as dist

    times: list[list[float]] = [[] for _ in steps]
    for i in range(warmup + repeats):
        for j, step in enumerate(steps):
            dist.barrier()
            start = time.thread_time()
            step()
            if i >= warmup:
                times[j].append(time.thread_time() - start)
    return [statistics.median(t) if t else math.nan for t in times]


def methods(spec: BenchSpec) -> list[tuple[str, Method]]:
    """(level, method) in order, each level's baseline (ALST) first."""
    us = list(dict.fromkeys(u for u in (spec.world, spec.heads) if u in spec.chunk_sizes))
    core = [("core", Method("alst", "alst")), ("core", Method("deepspeed", "deepspeed"))]
    core += [("core", Method.upipe(f"upipe[U={u}]", u, spec.overlap_comm)) for u in us]
    layer = [("layer", Method("alst", "alst"))]
    for u in us:
        layer.append(("layer", Method.upipe(f"upipe-fused[U={u}]", u, spec.overlap_comm)))
        recompute = Method.upipe(f"upipe-fused-recompute[U={u}]", u, spec.overlap_comm, recompute_attention_output=True)
        layer.append(("layer", recompute))
        if u == spec.world:  # accumulate_dtype "input": dK/dV per stage (where rounds have several stages)
            accumulate = Method.upipe(f"upipe-fused+input[U={u}]", u, spec.overlap_comm, accumulate_in_input_dtype=True)
            layer.append(("layer", accumulate))
    return core + layer


def _core_case(method: Method, spec: BenchSpec, seq: int, rank: int, device: torch.device) -> tuple:
    import torch.distributed as dist

    from .bench import _core_attention, _core_inputs

    data = _core_inputs(spec, seq, rank, device)
    attention = _core_attention(method, spec, dist.group.WORLD, data["pos"])

    def step() -> None:
        leaves = [data[n].detach().clone().requires_grad_(True) for n in "qkv"]
        attention(*leaves, 0).backward(data["dout"])

    step()  # warm: caches (plan indices, checked layouts) as in every step after the first
    qkvo = sum(_bytes(data[n]) for n in ("q", "k", "v", "dout"))
    return step, qkvo


def _layer_case(method: Method, spec: BenchSpec, seq: int, rank: int, device: torch.device) -> tuple:
    from .bench import build_layer, layer_inputs

    layer, rotary = build_layer(method, spec, device)
    x0, dy, pos, cos, sin = layer_inputs(rotary, spec, seq, rank, device)

    def step() -> None:
        x = x0.clone().requires_grad_(True)
        layer(x, position_embeddings=(cos, sin), position_ids=pos).backward(dy)
        layer.zero_grad(set_to_none=True)

    step()
    elt = x0.element_size()
    qkvo = spec.batch * (seq // spec.world) * (2 * spec.heads + 2 * spec.kv_heads) * spec.head_dim * elt
    return step, qkvo


def _rank_main(rank: int, world: int, spec: BenchSpec) -> list[OpCount]:
    from .ranks import report_progress

    device = torch.device("cpu")
    rows = []
    for seq in spec.seq_lens:
        timed: list[tuple[OpCount, Callable[[], Any]]] = []  # the layer level's rows and steps, when timed
        for level, method in methods(spec):
            make = _core_case if level == "core" else _layer_case
            step, qkvo = make(method, spec, seq, rank, device)
            counter = count_step(step)
            rows.append(
                OpCount(
                    level=level,
                    method=method.name,
                    seq_len=seq,
                    collectives=sum(counter.collectives.values()),
                    collective_kinds=dict(counter.collectives),
                    aten_ops=sum(counter.ops.values()),
                    copy_bytes=counter.copy_bytes,
                    qkvo_bytes=qkvo,
                    host_syncs=counter.host_syncs,
                    top_ops=dict(counter.ops.most_common(12)),
                )
            )
            if spec.repeats and level == "layer":
                timed.append((rows[-1], step))
            del step
            report_progress()
        seconds = interleaved_cpu_seconds([step for _, step in timed], spec.repeats, spec.warmup)
        for (row, _), cpu in zip(timed, seconds):
            row.cpu_s = cpu
        del timed
    return rows


def run_opcount(spec: BenchSpec, show_progress: bool = True, timeout: float = 7200) -> list[OpCount]:
    """Spawn ``spec.world`` gloo ranks; return rank 0's counts (with CPU-time ratios to ALST)."""
    from tqdm import tqdm

    from .ranks import run_ranks

    if spec.device != "cpu" or spec.ring_size != 1:
        raise ValueError("the op count runs on CPU gloo ranks without a ring (--device cpu --ring-size 1)")
    total = len(methods(spec)) * len(spec.seq_lens)
    with tqdm(total=total, desc="ds-upipe bench (ops)", unit="case", disable=not show_progress) as bar:
        per_rank = run_ranks(
            _rank_main,
            spec.world,
            spec,
            use_deepspeed=True,
            threads=1,
            timeout=timeout,
            on_progress=lambda r: bar.update(1) if r == 0 else None,
        )
    rows = per_rank[0]
    for i, r in enumerate(rows):  # the counts are rank 0's; the CPU time each rank's median, averaged
        r.cpu_s = statistics.fmean(ranks[i].cpu_s for ranks in per_rank)
    for r in rows:
        base = next(b for b in rows if b.level == r.level and b.seq_len == r.seq_len)
        r.cpu_ratio = r.cpu_s / base.cpu_s if base.cpu_s else math.nan
    return rows


def format_opcount_table(rows: list[OpCount]) -> str:
    lines = [
        "[ops] one forward+backward step, rank 0; copies x = copy bytes / bytes of local q, k, v, out; "
        "CPU = main-thread CPU seconds (layer level; median over steps, mean over ranks), x vs ALST"
    ]
    header = (
        f"{'level':<6}{'method':<28}{'seq':>7}{'collect.':>9}{'copies x':>10}{'aten ops':>10}{'syncs':>7}"
        f"{'CPU s':>9}{'x':>6}"
    )
    lines += [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.level:<6}{r.method:<28}{r.seq_len:>7}{r.collectives:>9}{r.copy_ratio:>10.2f}{r.aten_ops:>10}"
            f"{r.host_syncs:>7}{r.cpu_s:>9.3f}{r.cpu_ratio:>6.2f}"
        )
    return "\n".join(lines)


def as_json(rows: list[OpCount]) -> list[dict[str, Any]]:
    return [{**asdict(r), "copy_ratio": r.copy_ratio} for r in rows]
