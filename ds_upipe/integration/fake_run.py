"""Per-rank memory of the real code, run on fake tensors: what ``ds-upipe plan`` and ``"auto"`` use.

Nothing here models an allocation by hand.  Each measurement builds the real modules (a
transformers decoder layer patched by ``hf_patches.apply_upipe`` or wrapped by DeepSpeed ALST's
``UlyssesSPAttentionHF``, the long-context stack when asked, the final norm + lm_head + loss, or
ds_upipe's ``UPipeDistributedAttention``) and runs their forward and backward as rank 0 of a
group of C under

- torch's ``FakeTensorMode``: every tensor has its real shape, dtype and storage size, no data,
  so a Llama3-8B layer at millions of tokens runs in about half a second on a CPU;
- the ``fake`` process group (``init_process_group("fake", rank=0, world_size=C)``): collectives
  keep shapes and move nothing;
- torch's ``MemTracker``: the live bytes of every storage the code allocates, the peak, and (our
  subclass) the operation that set it and the largest tensors alive then.

What fake execution cannot see is added analytically, here only one term: the CUDA attention
kernel's backward workspace (``kernel_workspace_bytes``), added while the backward op runs.  The
terms of a whole GPU step (model states, ZeRO buffers, checkpoints) are ds_upipe.tools.planner's.

Data-dependent calls (``.item()``, ``.tolist()``) cannot run on fake tensors; the measured code
has none: the layer and the loss are called directly, so hf_patches' model-level input check
(all_gathers of the inputs' shapes and positions, ``.tolist()``) is not in the measured region
(it runs once per step on a few numbers per rank; its tensors are [2, b, S] integers).

A process that already has a default process group (a training job choosing ``"auto"``) cannot
open the fake one; ``isolated`` then runs the measurement in a child Python process.
"""

from __future__ import annotations

import contextlib
import functools
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.weak import WeakIdKeyDictionary

from .checkpointing import releasing, without_recomputed_outputs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
KERNELS = ("none", "fa2", "fa3")
_FLASH_BACKWARD = {
    "aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
    "aten._scaled_dot_product_flash_attention_backward.default",
}


# -- the one analytic term: the CUDA kernel's backward workspace ----------------------------------


def kernel_workspace_bytes(kernel: str, q: torch.Size, k: torch.Size, element_size: int) -> int:
    """Bytes a GPU flash-attention backward allocates inside the kernel for one call on q [b, h, S, d]
    and k [b, hkv, S, d] (besides dq, dk, dv, which the fake run counts).

    - "fa2" (torch SDPA's CUDA flash backward = flash-attn 2, what ALST's transformers "sdpa" and
      ds_upipe's TorchSDPAKernel run in 16-bit): ``dq_accum``, float32 [b, S, h, d]
      (flash-attn csrc/flash_attn/flash_api.cpp, mha_bwd), and under GQA dk/dv of the query
      heads' size (``dk_expanded``/``dv_expanded``, input dtype) summed to the KV heads afterwards.
    - "fa3" (flash-attn 3, hopper/flash_api.cpp): float32 ``dq_accum``, ``dk_accum``, ``dv_accum``.
    - "none": CPU, where MemTracker sees everything the op allocates.
    """
    if kernel == "none":
        return 0
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: choose one of {list(KERNELS)}")
    nq, nkv = q.numel(), k.numel()
    if kernel == "fa3":
        return 4 * nq + 2 * 4 * nkv
    return 4 * nq + (2 * element_size * nq if q[1] != k[1] else 0)


# -- the tracker ------------------------------------------------------------------------------------


@dataclass
class Peak:
    """The peak of one measured step on rank 0 (bytes), and what it is made of."""

    total: int  # everything tracked at the peak, the kernel workspace included
    weights: int  # of which the module's parameters (tracked for the whole step)
    workspace: int  # of which the analytic kernel workspace (0 unless the peak is inside a kernel backward)
    at: str  # the operation whose allocation set the peak
    live: list[tuple[str, int]] = field(default_factory=list)  # largest allocations alive then, by origin
    after_forward: int = 0  # live bytes right after the forward (saved for backward + output + inputs)
    #: the peak total of each phase of the step, where the step names its phases (``model_step``)
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def activations(self) -> int:
        """The peak without the parameters (ZeRO-partitioned or gathered: counted by the planner)."""
        return self.total - self.weights

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NoModuleTracking:
    """Stands in for MemTracker's ModTracker (also for ds_upipe.tools.memory's real measurements).  Its
    hooks on a module's inputs hold their gradients until every one has arrived, so autograd copies
    each input gradient instead of taking it over (the copy exists only under the tracker); and its
    backward hooks fail on modules called inside an autograd Function's no-grad forward (DeepSpeed's
    TiledMLP calls gate/up/down_proj there).  The per-storage accounting, and so the peak total, does
    not depend on it."""

    is_bw = False
    parents: set[str] = set()

    def register_user_hooks(self, *hooks: Any) -> None: ...

    def clear_user_hooks(self) -> None: ...

    def __enter__(self) -> NoModuleTracking:
        return self

    def __exit__(self, *args: Any) -> None: ...


class PeakTracker(MemTracker):
    """MemTracker that also names each storage's origin and, at the peak, the operation that set it.

    Origin: "forward <module path>: <op>" (module paths from global forward hooks) or "backward
    <autograd node>: <op>".  With ``kernel`` a GPU kernel, a flash backward op's workspace is counted
    on top of the live bytes while it runs (``kernel_workspace_bytes``)."""

    def __init__(
        self, kernel: str = "none", names: dict[int, str] | None = None, phase: Callable[[], str] | None = None
    ) -> None:
        super().__init__()
        self.phase = phase
        self.phase_peaks: dict[str, int] = {}
        self._mod_tracker = NoModuleTracking()
        self.kernel = kernel
        self.names = names or {}
        self.origins: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.modules: list[str] = []
        self.op = "before the step"
        self.extra = 0
        self.peak = Peak(0, 0, 0, "nothing allocated")
        self.weights = 0

    def label_external(self, label: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.origins[t.untyped_storage()] = label

    def _context(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            node = torch._C._current_autograd_node()
            return f"backward {node.name() if node is not None else '?'}"
        return f"forward {self.modules[-1]}" if self.modules else "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.op = f"{self._context()}: {func}"
        self.extra = 0
        if self.kernel != "none" and str(func) in _FLASH_BACKWARD:
            q, k = args[1], args[2]
            self.extra = kernel_workspace_bytes(self.kernel, q.shape, k.shape, q.element_size())
        res = super().__torch_dispatch__(func, types, args, kwargs)
        for t in (r for r in (res if isinstance(res, tuple | list) else (res,)) if isinstance(r, torch.Tensor)):
            self.origins.setdefault(t.untyped_storage(), self.op)
        self.extra = 0
        return res

    def _update_peak_stats(self, peak_state: Any) -> None:
        total = sum(snap["Total"] for snap in self._curr_mem_snap.values()) + self.extra
        if self.phase is not None:
            name = self.phase()
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), total)
        if total > self.peak.total:
            self.peak = Peak(total, self.weights, self.extra, self.op + (" (+ kernel workspace)" if self.extra else ""))

    def live_now(self, top: int = 10) -> list[tuple[str, int]]:
        """The largest live allocations, summed by origin."""
        by: dict[str, int] = {}
        for st, (winfo, _) in list(self._WINFO.items()):
            by[self.origins.get(st, "other")] = by.get(self.origins.get(st, "other"), 0) + winfo.mem_consumed
        return sorted(by.items(), key=lambda kv: -kv[1])[:top]

    def current(self) -> int:
        return sum(snap["Total"] for snap in self._curr_mem_snap.values())


def _forward_hooks(tracker: PeakTracker) -> contextlib.ExitStack:
    """Global module hooks keeping the stack of module paths the forward is in (for the labels)."""
    from torch.nn.modules import module as nn_module

    def pre(module: torch.nn.Module, *_: Any) -> None:
        tracker.modules.append(tracker.names.get(id(module), type(module).__name__))

    def post(module: torch.nn.Module, *_: Any) -> None:
        if tracker.modules:
            tracker.modules.pop()

    stack = contextlib.ExitStack()
    stack.callback(nn_module.register_module_forward_pre_hook(pre).remove)
    stack.callback(nn_module.register_module_forward_hook(post, always_call=True).remove)
    return stack


def track(
    step: Callable[[], Any],
    external: dict[str, list[torch.Tensor]],
    weights: list[torch.Tensor],
    *,
    kernel: str = "none",
    names: dict[int, str] | None = None,
    forward: Callable[[], Any] | None = None,
    live: bool = False,
    phase: Callable[[], str] | None = None,
) -> Peak:
    """The peak of ``step()`` (``forward()`` then ``step(forward's result)`` when ``forward`` is given),
    counting the ``external`` tensors (by label) and the ``weights``, with the live set at the peak.

    ``live``: run twice, the second run stopping when the first one's peak is reached again to
    record what is alive then (cheaper than a snapshot at every new high).  ``phase``: the name of the
    phase the step is in now (``Peak.phases`` then holds each phase's peak)."""
    first = _run(step, external, weights, kernel, names, forward, stop_at=None, phase=phase)
    if not live:
        return first
    for t in [*weights, *(t for ts in external.values() for t in ts)]:
        t.grad = None  # the second run allocates the gradients again
    second = _run(step, external, weights, kernel, names, forward, stop_at=first.total, phase=phase)
    first.live = second.live
    return first


class _StopAtPeak(Exception):
    pass


def _run(step, external, weights, kernel, names, forward, stop_at: int | None, phase=None) -> Peak:  # type: ignore[no-untyped-def]
    tracker = PeakTracker(kernel, names, phase)
    if stop_at is not None:
        original = tracker._update_peak_stats

        def update(peak_state: Any) -> None:
            original(peak_state)
            if tracker.peak.total >= stop_at:
                tracker.peak.live = tracker.live_now()
                if tracker.extra:
                    tracker.peak.live.insert(0, (f"kernel workspace ({kernel})", tracker.extra))
                raise _StopAtPeak

        tracker._update_peak_stats = update  # type: ignore[method-assign]
    tensors = [t for ts in external.values() for t in ts]
    tracker.track_external(*tensors, *weights)
    for label, ts in external.items():
        tracker.label_external(label, *ts)
    tracker.label_external("parameters", *weights)
    tracker.weights = sum(w.untyped_storage().nbytes() for w in {id(w): w for w in weights}.values())
    after_forward = 0
    try:
        with tracker, _forward_hooks(tracker):
            tracker.peak = Peak(tracker.current(), tracker.weights, 0, "before the step")
            if forward is not None:
                out = forward()
                after_forward = tracker.current()
                step(out)
                del out
            else:
                step()
    except _StopAtPeak:
        pass
    peak = tracker.peak
    peak.after_forward = after_forward
    peak.phases = dict(tracker.phase_peaks)
    return peak


# -- the fake world ----------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[dist.ProcessGroup]:
    """This process as rank 0 of a ``fake`` process group of ``world_size`` ranks, for the duration."""
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world needs a process without a default process group; use fake_run.isolated(...) instead"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        _release_deepspeed_sp_groups()
        dist.destroy_process_group()
        _forget_deepspeed_comm()


def _deepspeed_comm_on_fake_world() -> None:
    """deepspeed.comm over the fake group (ALST's parallel_state_sp and all-to-alls go through it)."""
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        with contextlib.redirect_stdout(sys.stderr):  # its shm-op build message would pollute stdout
            deepspeed.comm.init_distributed(dist_backend="fake", auto_mpi_discovery=False, verbose=False)


def _forget_deepspeed_comm() -> None:
    """Drop deepspeed.comm's backend object of the fake group (destroyed with it)."""
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None


def _release_deepspeed_sp_groups() -> None:
    """DeepSpeed's parallel_state_sp groups that ALST's registration made inside the fake world."""
    mpu = sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")
    if mpu is not None and mpu._SEQUENCE_PARALLEL_GROUP is not None:
        mpu._release_sequence_parallel_groups()


def isolated(function: str, **kwargs: Any) -> dict[str, Any]:
    """``function(**kwargs).as_dict()`` of this module, in this process when it has no process group,
    else in a child Python process (a training job's ranks: the fake group cannot coexist with theirs)."""
    if not dist.is_initialized():
        return _as_dict(globals()[function](**kwargs))
    code = "import json,sys; from ds_upipe.integration import fake_run; fake_run._child()"
    payload = json.dumps({"function": function, "kwargs": kwargs})
    done = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fake-tensor measurement {function}({kwargs}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child() -> None:
    request = json.loads(sys.stdin.read())
    result = _as_dict(globals()[request["function"]](**request["kwargs"]))
    print(json.dumps(result))


def _as_dict(result: Any) -> dict[str, Any]:
    return result if isinstance(result, dict) else result.as_dict()


# -- what is measured ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A Llama-family decoder as transformers builds it: ``model_type`` and the config keys that set sizes."""

    model_type: str  # llama, mistral, qwen2, qwen3
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    attention_bias: bool = False

    def config(self, layers: int = 1) -> Any:
        from transformers import AutoConfig

        return AutoConfig.for_model(
            self.model_type,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            attention_bias=self.attention_bias,
            num_hidden_layers=layers,
            max_position_embeddings=1 << 26,
            tie_word_embeddings=False,
            use_cache=False,
            attn_implementation="sdpa",
        )


@dataclass(frozen=True)
class HFModelConfig:
    """A real model's transformers (text) config, as JSON: the fake run builds its decoder layer from
    it (any architecture transformers knows, not only ``ModelShape``'s Llama family), so ``"auto"``
    measures the attention modules the model has (q/k norms, biases, each kind of layer's window ...)."""

    json_text: str

    @classmethod
    def of(cls, config: Any) -> HFModelConfig | None:
        """From a ``PretrainedConfig`` (its text config: a multimodal model's language model); None for a
        model type transformers cannot build from its name (remote code)."""
        from transformers import CONFIG_MAPPING

        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        values = text.to_dict()
        if values.get("model_type") not in CONFIG_MAPPING:  # what ``config()`` rebuilds it from
            return None
        # not part of the architecture: where the weights came from, remote code, quantization, dtype
        for key in ("_name_or_path", "architectures", "auto_map", "quantization_config", "dtype", "torch_dtype"):
            values.pop(key, None)
        return cls(json.dumps(values, sort_keys=True, default=str))

    @property
    def hidden_size(self) -> int:
        return int(json.loads(self.json_text)["hidden_size"])

    def layer_kinds(self) -> list[HFModelConfig]:
        """One config per distinct entry of ``layer_types`` (e.g. sliding and full attention), each
        whose first layer is of that kind, in order of first appearance; [self] without per-layer
        types.  ``"auto"`` measures each and keeps the largest, since every layer runs at the chosen U."""
        values = json.loads(self.json_text)
        kinds = values.get("layer_types")
        if not isinstance(kinds, list) or len(set(kinds)) <= 1:
            return [self]
        configs = []
        for kind in dict.fromkeys(kinds):
            first = kinds.index(kind)
            values["layer_types"] = [*kinds[first:], *kinds[:first]]  # same length, ``kind`` first
            configs.append(HFModelConfig(json.dumps(values, sort_keys=True, default=str)))
        return configs

    def config(self, layers: int = 1) -> Any:
        from transformers import AutoConfig

        values = json.loads(self.json_text)
        model_type = values.pop("model_type")
        if isinstance(values.get("layer_types"), list):  # per-layer attention types: those of the first layers
            values["layer_types"] = values["layer_types"][:layers]
        values.update(num_hidden_layers=layers, use_cache=False, attn_implementation="sdpa")
        return AutoConfig.for_model(model_type, **values)


@dataclass(frozen=True)
class StepSpec:
    """One rank's step of one decoder layer (or the loss): the run's attention scheme and stack."""

    model: ModelShape | HFModelConfig
    attention: str  # "alst" (DeepSpeed's UlyssesSPAttentionHF around transformers' sdpa) or "upipe"
    sp_size: int  # C: the whole sequence-parallel group, C_u x ring_size (fake_run uses no other group size)
    seq_len: int  # global tokens S (each rank holds S / C)
    head_chunk_size: int | None = None  # UPipe's U (None: C)
    fused: bool = True
    overlap_comm: bool = False
    accumulate_in_input_dtype: bool = False  # upipe.accumulate_dtype = "input"
    recompute_attention_output: bool = False  # upipe.recompute_attention_output (fused only)
    batch: int = 1
    dtype: str = "bf16"
    tiled_norm: bool = False
    tiled_mlp: bool = False
    tiled_loss: bool = False
    norm_tile_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    loss_tile_tokens: int | None = None
    kernel: str = "none"  # the analytic CUDA workspace: "none" (CPU), "fa2", "fa3"
    comm_backend: str = "nccl"  # whose async-Work buffer lifetime to reproduce: "nccl" or "gloo"
    #: UPipe x Ring: sp_size = C_u x ring_size; rank 0 runs UPipe over its C_u Ulysses ranks and the real
    #: RingAttentionKernel over a fake ring group of ring_size ranks (its K/V and dK/dV blocks in flight)
    ring_size: int = 1
    #: the layer runs as a checkpointed layer's replay in backward (``integration.checkpointing``)
    checkpointed: bool = False

    def __post_init__(self) -> None:
        if self.comm_backend not in ("nccl", "gloo"):
            raise ValueError(f"comm_backend={self.comm_backend!r}: choose 'nccl' or 'gloo'")
        if self.attention not in ("alst", "upipe"):
            raise ValueError(f"attention={self.attention!r}: choose 'alst' or 'upipe'")
        if self.seq_len < self.sp_size or self.seq_len % self.sp_size:
            raise ValueError(
                f"seq_len={self.seq_len} is not a positive multiple of the sequence-parallel size {self.sp_size}"
            )
        if self.ring_size != 1:
            from ..layout import sequence_layout

            if self.attention != "upipe":
                raise ValueError(
                    f"ring_size={self.ring_size}: DeepSpeed ALST has no ring; plan UPipe x Ring instead "
                    "(head_chunk_size = num_heads is Ulysses x Ring)"
                )
            layout = sequence_layout(self.sp_size, self.ring_size)
            multiple = layout.sequence_multiple  # two zigzag chunks per ring rank
            if self.seq_len % multiple:
                raise ValueError(
                    f"seq_len={self.seq_len}: with Ulysses degree {layout.ulysses_size} x ring size "
                    f"{self.ring_size} the sequence must be a multiple of {multiple}"
                )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}: choose one of {list(KERNELS)}")

    @property
    def local_tokens(self) -> int:
        return self.seq_len // self.sp_size


class _HeldWork:
    """An async collective's Work that keeps its tensors until it is dropped, as gloo's does."""

    def __init__(self, work: Any, tensors: tuple[torch.Tensor, ...]) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)


@contextlib.contextmanager
def _backend_retention(backend: str) -> Iterator[None]:
    """What the real backend keeps alive that the fake group does not: gloo's async Work holds its
    send and receive buffers until the handle dies (measured on CPU); NCCL releases them at wait(),
    as the fake group's Work does."""
    if backend != "gloo":
        yield
        return
    original = dist.all_to_all_single

    def all_to_all_single(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = original(output, input, *args, **kwargs)
        return _HeldWork(work, (output, input)) if kwargs.get("async_op") else work

    dist.all_to_all_single = all_to_all_single
    try:
        yield
    finally:
        dist.all_to_all_single = original


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def _fake_model(spec: StepSpec, layers: int = 1) -> Iterator[tuple[torch.nn.Module, dist.ProcessGroup]]:
    """(the spec's patched model (``_patched_model``), the fake group) on fake tensors, as rank 0 of a
    fake group of the spec's size, with the real backend's buffer retention: the setting every
    model-level fake run uses."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with (
        fake_world(spec.sp_size) as group,
        FakeTensorMode(),
        _patched_model(spec, group, layers=layers) as model,
        _backend_retention(spec.comm_backend),
    ):
        yield model, group


@contextlib.contextmanager
def _patched_model(spec: StepSpec, group: dist.ProcessGroup, layers: int = 1) -> Iterator[torch.nn.Module]:
    """A ``*ForCausalLM`` of ``layers`` decoder layers (fake weights) set up as the run sets it up; ALST's
    override of transformers' attention registry is undone afterwards."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import hf_patches

    with _default_dtype(DTYPES[spec.dtype]):
        model = AutoModelForCausalLM.from_config(spec.model.config(layers))
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        if spec.attention == "alst":
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

            _deepspeed_comm_on_fake_world()
            UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", spec.sp_size, spec.batch)
        else:
            ulysses, ring = _sequence_groups(spec, group)
            hf_patches.apply_upipe(
                model,
                ulysses,
                head_chunk_size=spec.head_chunk_size,
                fused_projections=spec.fused,
                overlap_comm=spec.overlap_comm,
                accumulate_in_input_dtype=spec.accumulate_in_input_dtype,
                recompute_attention_output=spec.recompute_attention_output,
                ring_group=ring,
            )
        if spec.tiled_norm or spec.tiled_mlp or spec.tiled_loss:
            hf_patches.apply_long_context_stack(
                model,
                tiled_loss=spec.tiled_loss,
                tiled_norm=spec.tiled_norm,
                tiled_mlp=spec.tiled_mlp,
                loss_tile_tokens=spec.loss_tile_tokens,
                norm_tile_tokens=spec.norm_tile_tokens,
                mlp_tile_tokens=spec.mlp_tile_tokens,
                forward_loss="sequence_parallel" if spec.tiled_loss else "local",
                loss_group=group,
            )
        yield model.train()
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original
        _release_deepspeed_sp_groups()


def _sequence_groups(spec: StepSpec, group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(Ulysses group, ring group or None) of rank 0 in the fake world of ``spec.sp_size`` ranks: the
    groups ``ds_upipe.ring.build_sequence_groups`` makes in a real run (new_group works on the fake backend)."""
    if spec.ring_size == 1:
        return group, None
    from ..ring import build_sequence_groups

    return build_sequence_groups(spec.sp_size, spec.ring_size)


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): name or type(m).__name__ for name, m in model.named_modules()}


@functools.lru_cache(maxsize=512)
def layer_step(spec: StepSpec, live: bool = False) -> Peak:
    """Rank 0's peak over one decoder layer's forward (with grad) and backward: the layer's weights,
    its input x, the incoming gradient dy, cos/sin and the position ids are alive throughout, the
    weight gradients from their creation on (what a checkpointed layer's recompute + backward holds
    besides the other layers' checkpoints: the reentrant checkpoint holds x and dy through the
    layer's backward; ``spec.checkpointed`` runs the layer as its replay does, through
    ``checkpointing.without_recomputed_outputs``, whose output stand-in frees the layer output).
    ``after_forward``: x, the output and what the layer saved for backward (what each layer keeps
    without checkpointing)."""

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    with _fake_model(spec) as (model, _):
        layer, rotary = model.model.layers[0], model.model.rotary_emb
        x = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        dy = torch.empty(spec.batch, s, hidden, dtype=dtype)
        pos = torch.arange(s).expand(spec.batch, s)
        with torch.no_grad():
            cos, sin = rotary(x, pos)

        call = functools.partial(layer, position_embeddings=(cos, sin), position_ids=pos)

        def forward() -> torch.Tensor:
            # checkpointed: what the checkpoint's replay in backward runs (its output a stand-in)
            return without_recomputed_outputs(call, x) if spec.checkpointed else call(x)

        def backward(y: torch.Tensor) -> None:
            y.backward(dy)

        external = {"layer input x": [x], "incoming gradient dy": [dy], "cos/sin, position ids": [cos, sin, pos]}
        return track(
            backward,
            external,
            list(layer.parameters()),
            kernel=spec.kernel,
            names=_names(model),
            forward=forward,
            live=live,
        )


@functools.lru_cache(maxsize=512)
def loss_step(spec: StepSpec, live: bool = False) -> Peak:
    """Rank 0's peak over the loss phase: the final norm, the lm_head and the sequence-parallel
    cross-entropy, forward and backward, from the last hidden state h (alive throughout, with its
    gradient).  ``spec.tiled_loss``: hf_patches' tiled loss (no full logits); else the full logits
    and ``hf_patches.sequence_parallel_loss``.  The attention scheme plays no part."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hf_patches

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    with fake_world(spec.sp_size) as group, FakeTensorMode(), _patched_model(spec, group) as model:
        h = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        labels = torch.zeros(spec.batch, s, dtype=torch.long)

        def forward() -> torch.Tensor:
            hidden_states = model.model.norm(h)
            if spec.tiled_loss:
                return hf_patches.tiled_sequence_parallel_loss(
                    model, hidden_states, labels, group, tile_tokens=spec.loss_tile_tokens
                )
            return hf_patches.sequence_parallel_loss(model.lm_head(hidden_states), labels, group)

        def backward(loss: torch.Tensor) -> None:
            loss.backward()

        weights = list(model.model.norm.parameters()) + list(model.lm_head.parameters())
        external = {"last hidden state h": [h], "labels": [labels]}
        return track(backward, external, weights, kernel=spec.kernel, names=_names(model), forward=forward, live=live)


#: the phases of ``model_step``, in the order a step runs them
STEP_PHASES = ("forward", "loss", "top layer", "bottom layer")


@functools.lru_cache(maxsize=512)
def model_step(spec: StepSpec, keep_gradients: bool = False, live: bool = False, layers: int = 2) -> Peak:
    """Rank 0's peak over one whole training step of a two-layer model: both decoder layers' forward,
    the final norm and the loss, and the backward through all of them, measured together, so what the
    loss phase keeps is seen beside the layers' backward (and the other way round).  ``Peak.phases``
    holds each phase's peak (``STEP_PHASES``: the forward; the loss phase, from the start of backward to
    the top layer's; the top layer's backward, a checkpoint's replay included; the bottom layer's).
    The planner adds, per phase, what the other ``layers - 2`` layers of a real model keep
    (``planner.predict``); the embedding is outside (its output, the bottom layer's input, is alive
    throughout, as the checkpoint DeepSpeed keeps of it).

    ``spec.checkpointed``: the layers run under DeepSpeed's reentrant checkpoint with the recomputed
    outputs released (``checkpointing.releasing``), as ``sp_setup.configure_activation_checkpointing``
    installs it; on this fake CPU device every checkpoint stays where it is (what a GPU run keeps without
    offload; with offload, the newest stays and the next one comes back during a layer's backward).
    ``keep_gradients``: each parameter's gradient lives from its creation to the end (one forward +
    backward from gradients set to None, what the CPU whole-step benchmark measures); otherwise it is
    dropped once accumulated, as ZeRO moves it into its reduce bucket (counted by the planner)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    import hf_patches

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    phase = ["forward"]
    with _fake_model(spec, layers=layers) as (model, group):
        base = model.model
        if spec.checkpointed:
            model._set_gradient_checkpointing(
                enable=True, gradient_checkpointing_func=releasing(ds_checkpointing.checkpoint)
            )
        if not keep_gradients:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        x = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        pos = torch.arange(s).expand(spec.batch, s)
        labels = torch.zeros(spec.batch, s, dtype=torch.long)
        with torch.no_grad():
            cos, sin = base.rotary_emb(x, pos)

        def enters(name: str) -> Callable[[torch.Tensor], None]:
            return lambda grad: phase.__setitem__(0, name)

        def forward() -> torch.Tensor:
            h = x
            names = ["bottom layer", *(f"layer {i}" for i in range(1, layers - 1)), "top layer"]
            for layer, name in zip(base.layers, names, strict=True):
                h = layer(h, position_embeddings=(cos, sin), position_ids=pos)
                h.register_hook(enters(name))  # the layer's backward starts when its output's gradient is there
            h = base.norm(h)
            if spec.tiled_loss:
                return hf_patches.tiled_sequence_parallel_loss(
                    model, h, labels, group, tile_tokens=spec.loss_tile_tokens
                )
            return hf_patches.sequence_parallel_loss(model.lm_head(h), labels, group)

        def backward(loss: torch.Tensor) -> None:
            phase[0] = "loss"
            loss.backward()

        external = {"bottom layer's input x": [x], "cos/sin, position ids": [cos, sin, pos], "labels": [labels]}
        return track(
            backward,
            external,
            list(model.parameters()),
            kernel=spec.kernel,
            names=_names(model),
            forward=forward,
            live=live,
            phase=lambda: phase[0],
        )


@functools.lru_cache(maxsize=512)
def core_step(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sp_size: int,
    head_chunk_size: int,
    seq_len: int,
    batch: int = 1,
    dtype: str = "bf16",
    kernel: str = "none",
    ring_size: int = 1,
    accumulate_in_input_dtype: bool = False,
    overlap_comm: bool = False,
) -> Peak:
    """Rank 0's peak over ``UPipeDistributedAttention`` (TorchSDPAKernel) forward+backward on
    [b, S/C, H, d] q and [b, S/C, Hkv, d] k, v, with the output gradient materialized; with
    ``ring_size`` R > 1 UPipe runs over C_u = sp_size / R ranks and ring attention over R (fake groups).  ``weights``
    holds the bytes of q, k, v, out, dout, dq, dk, dv (the inputs, output and their gradients), so
    ``activations`` is the stage buffers: ``intermediate``, the "intermediate" of docs/benchmarks.md."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..kernels import TorchSDPAKernel
    from ..layer import UPipeDistributedAttention
    from ..ring import build_sequence_groups

    t = DTYPES[dtype]
    s = seq_len // sp_size
    with fake_world(sp_size) as world, FakeTensorMode():
        group, ring = (world, None) if ring_size == 1 else build_sequence_groups(sp_size, ring_size)
        # validate_inputs=False: the documented trusted-inputs switch; the check's one all_gather of
        # a few int64 per rank ends in .tolist(), which fake tensors cannot run
        attn = UPipeDistributedAttention(
            TorchSDPAKernel(causal=True),
            group,
            head_chunk_size=head_chunk_size,
            validate_inputs=False,
            ring_group=ring,
            accumulate_in_input_dtype=accumulate_in_input_dtype,
            overlap_comm=overlap_comm,
        )
        q = torch.empty(batch, s, num_heads, head_dim, dtype=t).requires_grad_(True)
        k = torch.empty(batch, s, num_kv_heads, head_dim, dtype=t).requires_grad_(True)
        v = torch.empty(batch, s, num_kv_heads, head_dim, dtype=t).requires_grad_(True)
        dout = torch.empty(batch, s, num_heads, head_dim, dtype=t)

        def forward() -> torch.Tensor:
            return attn(q, k, v, batch_dim_idx=0)

        def backward(out: torch.Tensor) -> None:
            out.backward(dout)

        peak = track(backward, {"q, k, v": [q, k, v], "dout": [dout]}, [], kernel=kernel, forward=forward)
    io = 2 * (2 * q.numel() + k.numel() + v.numel()) * q.element_size()  # q k v out dout dq dk dv
    return intermediate(peak, io)


# -- what "auto" compares with upipe.memory_budget_gib: the one definition ---------------------------------


def intermediate(peak: Peak, io_bytes: int) -> Peak:
    """``peak`` with ``weights`` set to ``io_bytes``, so that ``activations`` is the attention's
    intermediate peak: what ``upipe.head_chunk_size: "auto"`` compares with ``upipe.memory_budget_gib``
    (docs/config.md).  The peak of the attention's forward + backward minus its inputs, its output,
    their gradients and its parameters and their gradients (what the rest of the step has anyway and
    ``ds-upipe plan`` counts elsewhere): the stage buffers, the all-to-all buffers in flight, the
    accumulators, the per-stage projections and what the attention saves from forward to backward."""
    peak.weights = io_bytes
    return peak


@functools.lru_cache(maxsize=512)
def attention_step(spec: StepSpec, packed: bool = False) -> Peak:
    """Rank 0's peak over the attention module of the first decoder layer of ``spec.model`` (one per
    kind of layer: ``HFModelConfig.layer_kinds``), forward + backward,
    run as the model runs it: built from ``spec.model`` (the real model's config on ``"auto"``'s
    routes), patched by ``hf_patches.apply_upipe`` with the spec's fused projections (apply_upipe's own
    fallback for that architecture), ``recompute_attention_output``, ``overlap_comm``, accumulation and
    ring, and called as the decoder layer calls it (hidden states, cos/sin, position ids, this
    forward's documents).  ``packed``: the row is packed as two documents, one token and the rest, so
    the kernel runs per document (``ds_upipe.packing.DocumentKernel``) with a segment of nearly the
    whole row beside the row's buffers (the most that per-document path holds).  ``activations``:
    ``intermediate``."""

    from hf_patches.architectures import find_decoder
    from hf_patches.state import DOCUMENTS_KWARG

    from ..packing import DocumentBoundaries

    dtype = DTYPES[spec.dtype]
    s, hidden = spec.local_tokens, spec.model.hidden_size
    with _fake_model(spec) as (model, _):
        attn = find_decoder(model).attentions[0]
        h = torch.empty(spec.batch, s, hidden, dtype=dtype).requires_grad_(True)
        dout = torch.empty(spec.batch, s, hidden, dtype=dtype)
        pos = torch.arange(s).expand(spec.batch, s)
        rotary = getattr(model.model, "rotary_emb", None)
        with torch.no_grad():
            cos_sin = rotary(h, pos) if rotary is not None else None
        kwargs: dict[str, Any] = {"position_ids": pos}
        if packed:
            kwargs[DOCUMENTS_KWARG] = DocumentBoundaries(((0, 1, spec.seq_len),))

        def forward() -> torch.Tensor:
            return attn(hidden_states=h, position_embeddings=cos_sin, attention_mask=None, **kwargs)[0]

        def backward(out: torch.Tensor) -> None:
            out.backward(dout)

        side = [pos, *(cos_sin or ())]
        weights = list(attn.parameters())
        peak = track(backward, {"hidden states h": [h], "dout": [dout], "cos/sin, position ids": side}, weights,
                     forward=forward)  # fmt: skip
    params = sum(w.untyped_storage().nbytes() for w in {id(w): w for w in weights}.values())
    io = 4 * h.untyped_storage().nbytes() + sum(t.untyped_storage().nbytes() for t in side)  # h dh out dout
    return intermediate(peak, 2 * params + io)


def attention_activations(head_chunk_sizes: list[int], *, model: str | None, **kwargs: Any) -> dict[str, int]:
    """The intermediate peak (``intermediate``) of every U, in one process (``"auto"``: one child process
    for all U).  ``model``: the JSON of the real model's config (``HFModelConfig``), measured with
    ``attention_step`` on a layer of each kind the model has (``HFModelConfig.layer_kinds``: sliding and
    full attention layers), unpacked and packed rows (without a ring; rings refuse packing): the
    largest counts, since every layer runs at the chosen U and whether a batch is packed is known only
    per forward.  None (the core
    layer's route, no HF model): ``core_step`` of ``UPipeDistributedAttention``."""
    if model is None:
        return {str(u): core_step(head_chunk_size=u, **kwargs).activations for u in head_chunk_sizes}
    kinds = HFModelConfig(model).layer_kinds()  # the JSON of HFModelConfig.of, one per kind of layer
    out = {}
    for u in head_chunk_sizes:
        # kwargs: sp_size, seq_len, batch, dtype, ring_size, overlap_comm, accumulate_in_input_dtype, fused,
        # recompute_attention_output (StepSpec's fields, as attention_stage_bytes_by_u passes them)
        specs = [StepSpec(kind, "upipe", head_chunk_size=u, **kwargs) for kind in kinds]
        packings = (False, True) if specs[0].ring_size == 1 else (False,)
        out[str(u)] = max(attention_step(spec, packed).activations for spec in specs for packed in packings)
    return out
