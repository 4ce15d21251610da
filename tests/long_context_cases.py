"""Rank-side bodies of the long-context stack tests (hf_patches.apply_long_context_stack, tiled loss,
norm and MLP); run with ds_upipe.tools.ranks.run_ranks.  Every comparison is against the untiled path
on the same weights and inputs: ``sequence_parallel_loss`` on the full logits, transformers' own
RMSNorm / MLP modules, and the unpatched single-process model."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import hf_patches
from hf_patches import tiling
from tests.hf_cases import (
    TOLERANCE,
    ZERO3_CONFIG,
    build_model,
    error_recorder,
    make_batch,
    reference_step,
    relative_error,
    summed_grads,
)

F32 = TOLERANCE[torch.float32]


def whole_stack(loss_tile_tokens: int, norm_tile_tokens: int, mlp_tile_tokens: int, **options) -> dict:
    """``apply_long_context_stack`` options: tiled loss, norms and MLPs with these tiles, and ``options``."""
    tiles = dict(loss_tile_tokens=loss_tile_tokens, norm_tile_tokens=norm_tile_tokens, mlp_tile_tokens=mlp_tile_tokens)
    return dict(tiled_loss=True, tiled_norm=True, tiled_mlp=True, **tiles, **options)


def _uneven_labels(batch: int, seq: int, world: int, seed: int, vocab: int = 101) -> torch.Tensor:
    """Full-sequence labels whose valid-token counts differ a lot between the ranks' shards: the
    first rank's shard is mostly ignored, one row of it entirely (uneven counts, empty rows)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    shard = seq // world
    labels[:, : shard - 2] = -100
    labels[0, :shard] = -100
    return labels


def _head_grads(model, hidden):
    head = model.get_output_embeddings()
    return [hidden.grad] + [p.grad for p in head.parameters()]


# ----------------------------------------------------------------------------- loss


def loss_case(dtype, batch, tile_tokens, tie, grad_reduction, upstream, group):
    """tiled_sequence_parallel_loss == sequence_parallel_loss(lm_head(hidden)): value, hidden and
    lm_head gradients, for an upstream gradient that is not 1 (gradient accumulation / loss scaling)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    seq = 6
    model = build_model("llama", dtype, tie_word_embeddings=tie)
    gen = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(batch, seq, model.config.hidden_size, generator=gen, dtype=dtype)
    labels = _uneven_labels(batch, seq * world, world, 7)[:, rank * seq : (rank + 1) * seq]
    results = []
    for tiled in (False, True):
        model.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_(True)
        if tiled:
            loss = hf_patches.tiled_sequence_parallel_loss(
                model, h, labels, group, grad_reduction=grad_reduction, tile_tokens=tile_tokens
            )
        else:
            loss = hf_patches.sequence_parallel_loss(model.lm_head(h), labels, group, grad_reduction=grad_reduction)
        (loss * upstream).backward()
        results.append([loss.detach()] + [g.detach().clone() for g in _head_grads(model, h)])
    errors = {"value": relative_error(results[1][0], results[0][0])}
    errors.update({f"grad_{i}": relative_error(g, r) for i, (g, r) in enumerate(zip(results[1][1:], results[0][1:]))})
    errors["value_is_global"] = float(not torch.isfinite(results[1][0]))
    return errors


def local_loss_case(dtype, group):
    """The stacked causal LM's forward with labels (forward_loss="local") == transformers' per-rank
    ForCausalLMLoss semantics, with and without num_items_in_batch; float64 stays float64."""
    import torch.nn.functional as F

    model = build_model("qwen3", dtype)
    ref = copy.deepcopy(model)
    hf_patches.apply_long_context_stack(model, tiled_loss=True, loss_tile_tokens=5)
    data = make_batch(3, 2, 12)
    errors = {}
    for num_items in (None, torch.tensor(17)):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        kwargs = {} if num_items is None else {"num_items_in_batch": num_items}
        got = model(input_ids=data["input_ids"], labels=data["labels"], **kwargs)
        logits = ref(input_ids=data["input_ids"]).logits
        shift = hf_patches.shift_labels(data["labels"])
        reduction = "mean" if num_items is None else "sum"
        want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1), reduction=reduction)
        want = want if num_items is None else want / num_items
        got.loss.backward()
        want.backward()
        key = "mean" if num_items is None else "num_items"
        errors[f"{key}_value"] = relative_error(got.loss.detach(), want.detach())
        errors[f"{key}_grads"] = max(
            relative_error(p.grad, dict(ref.named_parameters())[n].grad) for n, p in model.named_parameters()
        )
        errors[f"{key}_no_logits"] = float(got.logits is not None)
    out = model(input_ids=data["input_ids"])  # no labels: the original forward, full logits
    errors["logits_without_labels"] = relative_error(out.logits.detach(), ref(input_ids=data["input_ids"]).logits)
    return errors


def loss_cases(group):
    results = {}
    for dtype in (torch.float64, torch.float32):
        for batch, tile_tokens, tie, grad_reduction, upstream in (
            (1, 1, False, "mean", 1.0),
            (2, 5, False, "sum", 0.37),
            (2, 4, True, "mean", 0.37),  # tile of 2 positions x 2 rows; tied embedding
            (1, 100, True, "sum", 1.0),  # one tile
        ):
            name = f"{dtype} b={batch} tile={tile_tokens} tie={tie} {grad_reduction} x{upstream}"
            results[name] = loss_case(dtype, batch, tile_tokens, tie, grad_reduction, upstream, group)
        results[f"local {dtype}"] = local_loss_case(dtype, group)
    return results


# ----------------------------------------------------------------------------- norm and MLP


def module_case(arch, dtype, batch, seq, tile_tokens, part):
    """A stacked model's tiled RMSNorm / MLP == the module untiled: output, input gradient, weight
    gradients (the input is a non-leaf, as in the model)."""
    model = build_model(arch, dtype)
    ref = copy.deepcopy(model)
    options = {"tiled_norm": True, "norm_tile_tokens": tile_tokens}
    if part == "mlp":
        options = {"tiled_mlp": True, "mlp_tile_tokens": tile_tokens}
    hf_patches.apply_long_context_stack(model, **options)
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(batch, seq, model.config.hidden_size, generator=gen, dtype=dtype)
    grad = torch.randn(batch, seq, model.config.hidden_size, generator=gen, dtype=dtype)
    results = []
    for m in (ref, model):
        module = {"norm": m.model.norm, "layer_norm": m.model.layers[1].post_attention_layernorm}.get(part)
        module = module if module is not None else m.model.layers[0].mlp
        x = x0.clone().requires_grad_(True)
        out = module(x * 1.5)
        out.backward(grad)
        results.append([out.detach(), x.grad] + [p.grad for p in module.parameters()])
    errors = {f"t{i}": relative_error(g, r) for i, (g, r) in enumerate(zip(results[1], results[0]))}
    errors["tensors"] = float(len(results[1]) != len(results[0]) or len(results[0]) < 3)
    return errors


def module_cases():
    results = {}
    for arch, part in (("llama", "norm"), ("qwen3", "layer_norm"), ("llama", "mlp"), ("qwen2", "mlp")):
        for dtype in (torch.float64, torch.float32):
            for batch, seq, tile in ((1, 10, 3), (2, 9, 4), (2, 5, 1)):
                results[f"{arch} {part} {dtype} b={batch} s={seq} tile={tile}"] = module_case(
                    arch, dtype, batch, seq, tile, part
                )
    return results


def chunk_cases():
    """TiledMLP asks torch.chunk for `shards` tiles but marks the weights' gradients ready for ZeRO
    only at index shards - 1; torch.chunk makes fewer tiles for some lengths (6 rows in 4: 3).  The
    tile count is therefore chosen so that every rank's tokens split into exactly that many."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    linear = torch.nn.Linear(4, 4)
    x = torch.randn(6, 4, requires_grad=True)
    TiledMLP.apply(lambda m, t: m(t), linear, x, 4, [linear.weight, linear.bias]).sum().backward()
    return {
        "deepspeed_leaves_grad_not_ready": float(getattr(linear.weight, "ds_grad_is_ready", True) is not False),
        "exact_13_6": float(tiling.exact_chunk_tiles([13, 6], 2) != 3),
        "exact_10": float(tiling.exact_chunk_tiles([10], 3) != 4),
        "exact_one_rank_short": float(tiling.exact_chunk_tiles([100, 3], 10) != 3),
    }


# ----------------------------------------------------------------------------- whole model


def _own_group():
    """A group of this rank alone (new_group is collective: every rank creates every group)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def model_case(arch, fused, dtype, group, *, tie=False, checkpointing=None, upipe=True):
    """A model patched by apply_upipe (or not: each rank runs the whole sequence) with the whole
    stack on, loss from its forward (forward_loss="sequence_parallel") == the unpatched single-process
    model: loss and every parameter's gradient (summed over the ranks)."""
    world = dist.get_world_size(group)
    seq = 6 * world
    data = make_batch(11, 2, seq)
    data["labels"] = _uneven_labels(2, seq, world, 12)
    model = build_model(arch, dtype, tie_word_embeddings=tie)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), data)[1:]
    if upipe:
        hf_patches.apply_upipe(model, group, fused_projections=fused)
    if checkpointing is not None:
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    loss_group = group if upipe else _own_group()  # without SP each rank runs the whole sequence alone
    hf_patches.apply_long_context_stack(
        model, **whole_stack(5, 4, 3, forward_loss="sequence_parallel", loss_group=loss_group, grad_reduction="sum")
    )
    batch = hf_patches.shard_batch(data, group) if upipe else hf_patches.pad_batch(data, 1)
    if not upipe:
        batch["shift_labels"] = hf_patches.shift_labels(data["labels"])
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], shift_labels=batch["shift_labels"])
    out.loss.backward()
    grads = summed_grads(model, group) if upipe else {n: p.grad for n, p in model.named_parameters()}
    errors = {"loss": relative_error(out.loss.detach(), ref_loss), "logits_none": float(out.logits is not None)}
    errors["grad_names"] = float(sorted(grads) != sorted(ref_grads))
    errors["grads"] = max(relative_error(grads[n], ref_grads[n]) for n in ref_grads)
    return errors


def model_cases(group):
    results = {}
    for arch, fused, dtype, tie, checkpointing in (
        ("llama", True, torch.float64, False, None),
        ("qwen3", True, torch.float64, True, None),
        ("mistral", False, torch.float64, False, None),
        ("qwen2", True, torch.float32, False, None),
        ("llama", True, torch.float64, False, False),  # HF gradient checkpointing, non-reentrant
        ("qwen3", False, torch.float64, False, True),  # reentrant
    ):
        name = f"{arch} fused={fused} {dtype} tie={tie} checkpointing={checkpointing}"
        results[name] = model_case(arch, fused, dtype, group, tie=tie, checkpointing=checkpointing)
    results["plain llama (no UPipe)"] = model_case("llama", True, torch.float64, group, upipe=False)
    results["deepcopy"] = deepcopy_case(group)
    return results


def deepcopy_case(group):
    """A deep copy of a stacked, UPipe-patched model runs its own stack with the same loss group."""
    model = build_model("llama", torch.float64)
    hf_patches.apply_upipe(model, group)
    hf_patches.apply_long_context_stack(
        model, tiled_loss=True, tiled_norm=True, tiled_mlp=True, forward_loss="sequence_parallel", loss_group=group
    )
    clone = copy.deepcopy(model)
    shard = hf_patches.shard_batch(make_batch(4, 1, 12), group)
    losses = []
    for m in (model, clone):
        out = m(input_ids=shard["input_ids"], position_ids=shard["position_ids"], shift_labels=shard["shift_labels"])
        out.loss.backward()
        losses.append(out.loss.detach())
    stack, clone_stack = hf_patches.long_context_stack(model), hf_patches.long_context_stack(clone)
    return {
        "loss": relative_error(losses[1], losses[0]),
        "own_stack": float(clone_stack is stack or clone_stack.loss_group is not group),
        "own_modules": float(clone.model.norm.forward.__self__ is not clone.model.norm),
        "clone_grads_only": float(any(p.grad is None for p in clone.parameters())),
    }


# ----------------------------------------------------------------------------- memory


def _peak_activation(step, *tracked) -> int:
    """MemTracker peak of everything tracked minus parameters and their gradients (bytes)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(*tracked)
    with tracker:
        step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return peak["Total"] - peak.get("Parameter", 0) - peak.get("Gradient", 0)


class _LossPhase(torch.nn.Module):
    """The loss phase as one module call: MemTracker allows a module (lm_head, once per tile) to run
    several times per iteration only inside a parent module."""

    def __init__(self, model, loss):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self):
        return self.loss()


class _LayerProbe(torch.autograd.Function):
    """Stands for the decoder layers below the loss: ``record()`` runs during its backward."""

    @staticmethod
    def forward(ctx, x, record):
        ctx.record = record
        return x * 2.0

    @staticmethod
    def backward(ctx, grad):
        ctx.record()
        return grad * 2.0, None


def loss_input_during_layers_backward(model, group, seq: int) -> int:
    """MemTracker's Activation bytes live while the layers' backward runs, below a tiled loss whose
    input hidden state (the final norm's output) is the only activation of the forward.  With
    DeepSpeed's SequenceTiledCompute that hidden state stayed on its ctx for as long as the graph
    lived, i.e. through every layer's backward; TiledLossSum releases it after the loss's backward."""
    from torch.distributed._tools.mem_tracker import MemTracker

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, seq, model.config.hidden_size, generator=gen).requires_grad_(True)
    labels = torch.randint(0, model.config.vocab_size, (1, seq), generator=gen)
    tracker = MemTracker()
    tracker.track_external(model, x, labels)
    seen: dict = {}

    def record():
        seen.update(next(iter(tracker.get_tracker_snapshot("current").values())))

    def loss():
        hidden = _LayerProbe.apply(x, record)
        return hf_patches.tiled_sequence_parallel_loss(model, hidden, labels, group, tile_tokens=64)

    phase = _LossPhase(model, loss)
    with tracker:
        phase().backward()
    model.zero_grad(set_to_none=True)
    return next(v for k, v in seen.items() if getattr(k, "value", None) == "Activation")


def memory_cases(group):
    """Loss phase (lm_head + cross-entropy, forward + backward) at an activation-dominated shape
    (vocab 2048, 1024 tokens per rank): full logits vs tiles of 64 tokens.  RMSNorm in bfloat16
    (4096 tokens, hidden 64): what the tiled norm holds beyond the bfloat16 input, output and input
    gradient, against one float32 copy of the hidden state."""
    rank = dist.get_rank(group)
    model = build_model(
        "llama", torch.float32, vocab_size=2048, hidden_size=32, intermediate_size=32, num_hidden_layers=1
    )
    seq = 1024
    gen = torch.Generator().manual_seed(rank)
    hidden = torch.randn(1, seq, 32, generator=gen).requires_grad_(True)
    labels = torch.randint(0, 2048, (1, seq), generator=gen)
    labels[:, : 100 * (rank + 1)] = -100

    full_phase = _LossPhase(model, lambda: hf_patches.sequence_parallel_loss(model.lm_head(hidden), labels, group))
    tiled_phase = _LossPhase(
        model, lambda: hf_patches.tiled_sequence_parallel_loss(model, hidden, labels, group, tile_tokens=64)
    )

    def full():
        full_phase().backward()

    def tiled():
        tiled_phase().backward()

    results = {}
    for name, step in (("loss_full", full), ("loss_tiled", tiled)):
        step()  # warm-up
        hidden.grad = None
        model.zero_grad(set_to_none=True)
        results[name] = _peak_activation(step, model, hidden, labels)
    results["logits_fp32"] = seq * 2048 * 4
    results["act_in_layers_backward"] = loss_input_during_layers_backward(model, group, seq)
    results["hidden_fp32_loss"] = seq * 32 * 4

    norm_model = build_model("llama", torch.bfloat16, hidden_size=64, num_hidden_layers=1)
    ref_norm = copy.deepcopy(norm_model.model.norm)
    hf_patches.apply_long_context_stack(norm_model, tiled_norm=True, norm_tile_tokens=256)
    x = torch.randn(1, 4096, 64, generator=gen).to(torch.bfloat16).requires_grad_(True)
    for name, norm in (("norm_full", ref_norm), ("norm_tiled", norm_model.model.norm)):
        results[name] = _peak_activation(lambda norm=norm: norm(x).sum().backward(), norm, x)
        x.grad = None
    results["hidden_bf16"] = x.numel() * 2
    results["hidden_fp32"] = x.numel() * 4

    # MLP forward (float32, 2048 tokens, hidden 64, intermediate 128, 32 tiles of 64): the stack's
    # tiled MLP writes each tile into one output buffer; DeepSpeed's TiledMLP (what the stack used
    # before) keeps every tile's output in a list and concatenates them, two outputs alive at the cat
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    mlp_model = build_model("llama", torch.float32, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    mlp = mlp_model.model.layers[0].mlp
    forward = type(mlp).forward
    params = list(mlp.parameters())
    x = torch.randn(1, 2048, 64, generator=gen).requires_grad_(True)

    # the forward (where a checkpointed layer's recompute holds the most; the backward's peak is the
    # same for both: one tile's recompute beside x and its gradient)
    def deepspeed_tiled() -> torch.Tensor:
        return TiledMLP.apply(tiling._no_grad_detached(forward), mlp, x.reshape(-1, 64), 32, params)

    def stack_tiled() -> torch.Tensor:
        return tiling.tiled_mlp(mlp, forward, x, 64)

    for name, step in (("mlp_deepspeed", deepspeed_tiled), ("mlp_tiled", stack_tiled)):
        phase = _LossPhase(mlp, step)  # the projections run once per tile: inside one parent module call
        results[name] = _peak_activation(phase, mlp, x)
        x.grad = None
        mlp.zero_grad(set_to_none=True)
    results["mlp_output"] = x.numel() * 4
    return results


# ----------------------------------------------------------------------------- refusals


def refusal_cases(group):
    """Each bad setting raises ValueError before any change (same message on every rank)."""
    import transformers

    messages = {}
    expect = error_recorder(messages)

    stack = hf_patches.apply_long_context_stack
    expect("base_model_loss", lambda: stack(build_model("llama", base=True), tiled_loss=True))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    expect("unsupported_arch", lambda: stack(gpt2, tiled_mlp=True))
    expect("tile_zero", lambda: stack(build_model("llama"), tiled_mlp=True, mlp_tile_tokens=0))
    expect("tile_float", lambda: stack(build_model("llama"), tiled_norm=True, norm_tile_tokens=2.5))
    expect("forward_loss_without_tiled", lambda: stack(build_model("llama"), forward_loss="sequence_parallel"))
    expect("forward_loss_name", lambda: stack(build_model("llama"), tiled_loss=True, forward_loss="global"))
    expect("grad_reduction", lambda: stack(build_model("llama"), tiled_loss=True, grad_reduction="avg"))
    model = stack(build_model("llama"), tiled_norm=True)
    expect("twice", lambda: stack(model, tiled_mlp=True))
    wrapped = build_model("llama")
    wrapped.model.layers[0].mlp.forward = lambda x: x  # another library's wrapper
    expect("foreign_forward", lambda: stack(wrapped, tiled_norm=True, tiled_mlp=True))
    messages["foreign_forward_untouched"] = str("forward" in vars(wrapped.model.norm))
    base = build_model("llama", base=True)
    hidden = torch.zeros(1, 3, 64)
    expect("loss_on_base", lambda: hf_patches.tiled_sequence_parallel_loss(base, hidden, torch.zeros(1, 3), group))
    expect(
        "loss_shapes",
        lambda: hf_patches.tiled_sequence_parallel_loss(build_model("llama"), hidden, torch.zeros(1, 4).long(), group),
    )
    return messages


def components(rank, world):
    """Everything without DeepSpeed engines, in one spawn."""
    group = dist.group.WORLD
    return {
        "loss": loss_cases(group),
        "modules": module_cases(),
        "chunks": chunk_cases(),
        "models": model_cases(group),
        "memory": memory_cases(group),
        "refusals": refusal_cases(group),
    }


# ----------------------------------------------------------------------------- DeepSpeed ZeRO


def _count_bucket_adds(engine) -> dict[int, int]:
    """How often ZeRO-3 adds each parameter's gradient to its reduction bucket (must be once)."""
    counts: dict[int, int] = {}
    optimizer = engine.optimizer
    name = "_DeepSpeedZeroOptimizer_Stage3__add_grad_to_ipg_bucket"
    original = getattr(optimizer, name)

    def counting(param):
        counts[id(param)] = counts.get(id(param), 0) + 1
        return original(param)

    setattr(optimizer, name, counting)
    return counts


def zero_case(stage, arch, tie, world):
    """One ZeRO-2 / ZeRO-3 step of a UPipe model with the whole stack (loss from the engine's
    forward) == the unpatched single-process model; under ZeRO-3 each gradient reduced once (ZeRO-2
    asserts that itself).  The stack is applied after deepspeed.initialize (ZeRO-3 has partitioned
    the weights): the tiles' lm_head / MLP calls gather them, the norms run inside theirs."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.utils import safe_get_full_grad

    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=world)
    group = mpu.get_sequence_parallel_group()
    seq = 6 * world
    data = make_batch(5, 2, seq)
    data["labels"] = _uneven_labels(2, seq, world, 6)
    model = build_model(arch, torch.float32, tie_word_embeddings=tie)
    ref_loss, ref_grads = reference_step(copy.deepcopy(model), data)[1:]
    hf_patches.apply_upipe(model, group)
    config = copy.deepcopy(ZERO3_CONFIG)
    config["zero_optimization"]["stage"] = stage
    # ZeRO-1/2 with DeepSpeed's SP mpu scale gradients by sp (DeepSpeed #5248, which ds_upipe.initialize
    # corrects): at stage 2 the sequence group is the data-parallel world here, without the mpu
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, mpu=mpu if stage == 3 else None
    )
    hf_patches.apply_long_context_stack(
        engine, **whole_stack(5, 4, 3, forward_loss="sequence_parallel", loss_group=group)
    )
    counts = _count_bucket_adds(engine) if stage == 3 else {}
    shard = hf_patches.shard_batch(data, group)
    out = engine(input_ids=shard["input_ids"], position_ids=shard["position_ids"], shift_labels=shard["shift_labels"])
    engine.backward(out.loss)
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    added = [counts.get(id(p), 0) for p in engine.module.parameters()]
    engine.step()
    engine.destroy()
    errors = {"loss": relative_error(out.loss.detach(), ref_loss)}
    errors["grad_names"] = float(sorted(grads) != sorted(ref_grads))
    errors["grads"] = max(relative_error(grads[n], ref_grads[n]) for n in ref_grads)
    errors["reduced_once"] = float(stage == 3 and any(c != 1 for c in added))
    return errors


def zero3_uneven_case(rank, world):
    """ZeRO-3 data parallelism without sequence parallelism, each rank its own sample of a different
    length (13 and 7 tokens): the ranks agree on the tile counts of the lm_head and MLP calls (each
    one all-gathers the weights) and the averaged gradient equals the average of the per-sample
    gradients of the unpatched model (loss from the forward, transformers' per-rank mean)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    lengths = [13, 7, 9, 5][:world]
    samples = [make_batch(30 + r, 1, n) for r, n in enumerate(lengths)]
    model = build_model("llama", torch.float32)
    refs = [reference_step(copy.deepcopy(model), sample)[2] for sample in samples]
    want = {n: sum(ref[n] for ref in refs) / world for n in refs[0]}
    config = copy.deepcopy(ZERO3_CONFIG)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    hf_patches.apply_long_context_stack(engine, **whole_stack(3, 2, 2))
    mine = samples[rank]
    out = engine(input_ids=mine["input_ids"], labels=mine["labels"])
    engine.backward(out.loss)
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"grads": max(relative_error(grads[n], want[n]) for n in want)}


def zero_cases(rank, world):
    results = {}
    # ZeRO-2 first: once DeepSpeed's sequence-parallel mpu exists in the process (the ZeRO-3 cases
    # create it), ZeRO-2 engines pick it up and scale gradients by sp (DeepSpeed #5248)
    for stage, arch, tie in ((2, "llama", True), (2, "qwen2", False), (3, "llama", False), (3, "qwen3", True)):
        if stage == 3 and "zero3 uneven lengths" not in results:
            results["zero3 uneven lengths"] = zero3_uneven_case(rank, world)
        results[f"zero{stage} {arch} tie={tie}"] = zero_case(stage, arch, tie, world)
    return results
