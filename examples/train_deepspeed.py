#!/usr/bin/env python
"""Train a Llama-family model on long sequences with DeepSpeed and UPipe sequence parallelism.

    deepspeed --num_gpus 4 examples/train_deepspeed.py --deepspeed_config ds_configs/upipe_zero3.json

On a machine without GPUs the same command runs 4 CPU processes over gloo; add
``--set bf16.enabled=false`` there (most CPUs emulate bf16 matmuls, about 3x slower than float32).

The ds_config's ``sequence_parallel_size`` and ``"upipe"`` block choose the sequence parallelism
(``"upipe": {"enabled": false}`` runs DeepSpeed ALST's Ulysses instead); everything else is
ordinary DeepSpeed.  By default the model is a small Llama built from a config and the text is
generated (nothing is downloaded); ``--model PATH`` trains a local HF checkpoint instead.

Reports per step: loss, gradient norm, tokens/s and peak memory (rank 0, tqdm), and with
``--metrics_out`` writes them as JSON.  ``--save_dir``/``--save_every`` save DeepSpeed checkpoints,
``--resume DIR`` continues from the latest one (same data order, so the same loss trajectory), also
across sequence_parallel_size values at the same world size.
``--packing N`` packs N documents of random lengths into each sequence (position_ids restart per
document, as transformers' ``DataCollatorWithFlattening`` does): UPipe, and ALST with sdpa, attend
within each document only.
``--runs FILE`` runs several configurations one after another in one launch (tests use it).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import math
import os
import random
import resource
import sys
import time
import traceback
from typing import Any

import torch

WORDS = {
    "subject": ["the cat", "a dog", "my friend", "the engineer", "our team", "the model", "a bird", "the river"],
    "verb": ["sees", "builds", "follows", "trains", "finds", "carries", "watches", "counts"],
    "object": ["the ball", "a bridge", "long sequences", "the stars", "a red box", "the numbers", "a map", "the sea"],
    "tail": ["today", "at night", "slowly", "with care", "again", "in the rain", "every day", "for fun"],
}


def generated_text(num_chars: int, seed: int = 1234) -> str:
    """Deterministic English-like text with learnable structure (sentences, counting)."""
    rng = random.Random(seed)
    parts, size, n = [], 0, 0
    while size < num_chars:
        n += 1
        s = f"{n}. {rng.choice(WORDS['subject'])} {rng.choice(WORDS['verb'])} {rng.choice(WORDS['object'])} "
        s += f"{rng.choice(WORDS['tail'])}.\n"
        parts.append(s)
        size += len(s)
    return "".join(parts)[:num_chars]


class TokenBlocks(torch.utils.data.Dataset):
    """Consecutive blocks of ``seq_len`` tokens; labels = input_ids (the model shifts them).

    ``documents`` > 1: each block is a packed row of that many documents of random lengths (fixed per
    block), as transformers' ``DataCollatorWithFlattening`` lays them out: position_ids restart at
    each document and each document's first label is -100, so no token predicts across a boundary."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, num_samples: int, documents: int = 1) -> None:
        if num_samples < 1:
            raise ValueError(f"the text has {len(tokens)} tokens, too few for one sequence of {seq_len}")
        if not 1 <= documents <= seq_len:
            raise ValueError(f"--packing {documents}: must be between 1 and seq_len={seq_len}")
        self.tokens, self.seq_len, self.num_samples, self.documents = tokens, seq_len, num_samples, documents

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.tokens[i * self.seq_len : (i + 1) * self.seq_len]
        labels, positions = ids.clone(), torch.arange(self.seq_len)
        if self.documents > 1:
            gen = torch.Generator().manual_seed(i)  # the same documents in every parallel layout
            starts = (torch.randperm(self.seq_len - 1, generator=gen)[: self.documents - 1] + 1).sort().values
            starts = torch.cat([torch.zeros(1, dtype=torch.long), starts])
            lengths = torch.diff(starts, append=torch.tensor([self.seq_len]))
            positions = torch.cat([torch.arange(int(n)) for n in lengths])
            labels[starts] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--deepspeed_config", default=None, help="ds_config JSON (e.g. ds_configs/upipe_zero3.json)")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="override ds_config entries, JSON values (KEY=null removes one): zero_optimization.stage=1",
    )
    p.add_argument("--model", default=None, help="local HF checkpoint directory (default: small Llama from a config)")
    p.add_argument("--model_config", default="{}", help="JSON overrides of the default Llama config")
    p.add_argument("--data", default=None, help="UTF-8 text file to train on (default: generated text)")
    p.add_argument("--seq_len", type=int, default=4096, help="global tokens per sequence")
    p.add_argument(
        "--packing", type=int, default=1, help="documents of random lengths packed into each sequence (1: none)"
    )
    p.add_argument("--num_samples", type=int, default=256, help="sequences of generated text (without --data)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps in total (a resumed run counts from 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save_dir", default=None)
    p.add_argument("--save_every", type=int, default=0, help="save a checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    p.add_argument("--resume_tag", default=None, help="checkpoint tag to resume from (default: the latest)")
    p.add_argument(
        "--hf_gradient_checkpointing",
        action="store_true",
        help="enable the model's own (torch) activation checkpointing; ds_config activation_checkpointing overrides it",
    )
    p.add_argument(
        "--measure_activations",
        action="store_true",
        help="measure the first micro-step's forward + backward: its peak memory above the pre-step level (CUDA: "
        "allocated; CPU: resident set, VmHWM - VmRSS), as activation_peak_bytes in the metrics",
    )
    p.add_argument("--metrics_out", default=None, help="write per-step metrics of every run as JSON (rank 0)")
    p.add_argument("--runs", default=None, help="JSON file with a list of runs (objects of these options + name)")
    p.add_argument("--no_progress", action="store_true", help="no tqdm bar")
    return p.parse_args(argv)


def set_dotted(config: dict[str, Any], assignment: str) -> None:
    key, sep, raw = assignment.partition("=")
    if not sep:
        raise ValueError(f"--set expects KEY=VALUE, got {assignment!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    node = config
    *parents, leaf = key.split(".")
    for name in parents:
        node = node.setdefault(name, {})
    if value is None:
        node.pop(leaf, None)  # KEY=null removes the entry
    else:
        node[leaf] = value


def build_ds_config(opts: argparse.Namespace) -> dict[str, Any]:
    if opts.deepspeed_config is None:
        raise ValueError("--deepspeed_config is required")
    with open(opts.deepspeed_config, encoding="utf-8") as f:
        config = json.load(f)
    for assignment in opts.set:
        set_dotted(config, assignment)
    return config


def build_model_and_tokens(opts: argparse.Namespace, num_tokens: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    text = open(opts.data, encoding="utf-8").read() if opts.data else generated_text(num_tokens)
    torch.manual_seed(opts.seed)
    if opts.model:
        model = AutoModelForCausalLM.from_pretrained(opts.model, attn_implementation="sdpa", dtype=torch.float32)
        try:
            tokenizer = AutoTokenizer.from_pretrained(opts.model)
            tokens = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        except (OSError, ValueError):  # no tokenizer files: bytes
            tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long) % model.config.vocab_size
    else:
        from ds_upipe.tools.models import tiny_config

        fields = dict(
            vocab_size=256,  # byte-level text: no tokenizer to download
            hidden_size=128,
            intermediate_size=256,
            num_attention_heads=8,
            max_position_embeddings=opts.seq_len,
            rope_theta=10000.0,
        )
        config = tiny_config(**{**fields, **json.loads(opts.model_config)})
        model = LlamaForCausalLM(config)
        tokens = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    return model, tokens


def compute_loss(engine: Any, batch: dict[str, torch.Tensor], sp: int) -> torch.Tensor:
    from hf_patches import long_context_stack, sequence_parallel_loss

    batch = {k: v.to(engine.device) for k, v in batch.items() if torch.is_tensor(v)}
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    stack = long_context_stack(engine.module)
    if sp == 1:
        return engine(**inputs, labels=batch["labels"]).loss  # with upipe.tiled_loss: tiled, same value
    if stack is not None and stack.tiled_loss:
        # upipe.tiled_loss: the model computes sequence_parallel_loss from its last hidden state in
        # tiles (ds_upipe.initialize set forward_loss="sequence_parallel"); no full logits exist
        return engine(**inputs, shift_labels=batch["shift_labels"]).loss
    # this rank's shard: the loss of the whole sequence on every rank, with the gradient scale that
    # ds_upipe.initialize's ZeRO average expects (grad_reduction="mean")
    logits = engine(**inputs).logits
    return sequence_parallel_loss(logits, batch["shift_labels"], engine.seq_parallel_group)


def long_context_record(model: torch.nn.Module) -> dict[str, Any] | None:
    """What the long-context stack replaced (None without it), for the metrics."""
    from hf_patches import long_context_stack

    stack = long_context_stack(model)
    if stack is None:
        return None
    return {"tiled_loss": stack.tiled_loss, "tiled_norm": stack.tiled_norm, "tiled_mlp": stack.tiled_mlp,
            "forward_loss": stack.forward_loss, "patched": len(stack.patched)}  # fmt: skip


def batches_forever(loader: Any):
    """The loader's batches, epoch after epoch (in the same order: DeepSpeed's own loader, used
    without sequence parallelism, never reshuffles, and an SP run must see what it sees)."""
    while True:
        yield from loader


def end_iteration(data: Any, loader: Any) -> None:
    """Shut this run's loader iteration down now, worker processes included.

    DeepSpeed's training loader (the non-SP runs') starts 2 worker processes per iteration.  Left to
    the garbage collector, the iterator was shut down inside a later run (ZeRO-3's and BF16_Optimizer's
    ``gc.collect()``), where joining its workers timed out (5 s per worker: 10 s added to that run's
    initialization, three times in the tests' 2-process launch and once in the 4-process one); shut down
    here it takes under 0.5 s."""
    data.close()
    inner = getattr(loader, "data", None)  # DeepSpeedDataLoader: its generator over the torch iterator
    if hasattr(inner, "close"):
        inner.close()


def _proc_status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no {key}")


def measure_cpu_allocations() -> None:
    """glibc: every allocation of 128 KiB or more is an mmap returned to the OS when freed (the
    default threshold grows with use, after which freed tensors stay resident and hide the step's
    peak from VmHWM)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    m_mmap_threshold = -3
    libc.mallopt(m_mmap_threshold, 128 * 1024)


def forward_backward(engine: Any, batch: dict[str, torch.Tensor], sp: int, measure: bool) -> tuple[Any, int | None]:
    """(loss, the peak growth of memory during this forward + backward, or None unmeasured):
    what the step holds at its peak above what was held before it (activations, temporaries,
    ZeRO-3's gathered weights and gradient buffers; not the parameters or optimizer states).
    CUDA: the allocator's peak above the pre-step allocation.  CPU (Linux): the resident set's
    peak (VmHWM, reset through /proc/self/clear_refs before the step) above the pre-step VmRSS, with
    glibc's mmap threshold fixed at 128 KiB (``measure_cpu_allocations``) and the free heap trimmed
    first, so that every tensor above 128 KiB is its own mapping, resident while alive."""
    if not measure:
        loss = compute_loss(engine, batch, sp)
        engine.backward(loss)
        return loss, None
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
        base = torch.cuda.memory_allocated(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        loss = compute_loss(engine, batch, sp)
        engine.backward(loss)
        torch.cuda.synchronize(engine.device)
        return loss, int(torch.cuda.max_memory_allocated(engine.device) - base)
    gc.collect()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc_trim(0)  # hand freed heap back, so the step's allocations show in the resident set
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as f:
        f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
    base = _proc_status_kib("VmRSS")
    loss = compute_loss(engine, batch, sp)
    engine.backward(loss)
    return loss, (_proc_status_kib("VmHWM") - base) * 1024


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS, Linux reports KiB


def train(opts: argparse.Namespace) -> dict[str, Any]:
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from tqdm import tqdm
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import ds_upipe
    from hf_patches import upipe_state

    t_init = time.perf_counter()
    if getattr(opts, "measure_activations", False) and not torch.cuda.is_available():
        measure_cpu_allocations()
    ds_config = build_ds_config(opts)
    model, tokens = build_model_and_tokens(opts, opts.num_samples * opts.seq_len + 1)
    # the dataset depends on the text only, never on the parallel layout: runs with different
    # sequence_parallel_size see the same samples in the same order
    dataset = TokenBlocks(tokens, opts.seq_len, (len(tokens) - 1) // opts.seq_len, opts.packing)
    if opts.hf_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    engine, _, loader, _ = ds_upipe.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], training_data=dataset,
        config=ds_config,
    )  # fmt: skip
    sp = engine.upipe_settings.sequence_parallel_size
    init_s = time.perf_counter() - t_init
    rank, world = dist.get_rank(), dist.get_world_size()
    device = engine.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    start = 0
    if opts.resume:
        path, client_state = engine.load_checkpoint(opts.resume, tag=opts.resume_tag)
        if path is None:
            raise ValueError(f"no checkpoint found in {opts.resume}")
        start = int(client_state["step"])
    data = batches_forever(loader)
    for _ in range(start * engine.gradient_accumulation_steps()):  # same data order as the uninterrupted run
        next(data)

    tokens_per_step = engine.train_batch_size() * opts.seq_len
    record: dict[str, Any] = {"name": getattr(opts, "name", "run"), "steps": [], "losses": [], "grad_norms": []}
    record["tokens_per_s"] = []
    bar = tqdm(range(start, opts.steps), disable=rank != 0 or opts.no_progress, desc=record["name"], file=sys.stdout)
    t_run = time.perf_counter()
    activation_peak = None
    for step in bar:
        t0 = time.perf_counter()
        micro_losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            measure = bool(getattr(opts, "measure_activations", False)) and activation_peak is None
            loss, measured = forward_backward(engine, next(data), sp, measure)
            activation_peak = measured if measured is not None else activation_peak
            engine.step()
            micro_losses.append(loss.detach().float())
        step_loss = torch.stack(micro_losses).mean().to(device)
        dist.all_reduce(step_loss)  # sequence ranks hold equal values: sum / world is the data-parallel mean
        step_loss = step_loss.item() / world
        grad_norm = engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        get_accelerator().synchronize()
        tok_s = tokens_per_step / (time.perf_counter() - t0)
        values = {"steps": step + 1, "losses": step_loss, "grad_norms": grad_norm, "tokens_per_s": tok_s}
        for key, value in values.items():
            record[key].append(value)
        peak = peak_memory_bytes(device)
        bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tok_s:.0f}", peak_gib=f"{peak / 2**30:.2f}")
        if rank == 0 and opts.no_progress:
            print(f"step {step + 1}: loss {step_loss:.6f} grad_norm {grad_norm:.6f} {tok_s:.0f} tok/s", flush=True)
        if opts.save_dir and opts.save_every and (step + 1) % opts.save_every == 0:
            engine.save_checkpoint(opts.save_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
    if opts.save_dir and (not opts.save_every or opts.steps % opts.save_every != 0):
        engine.save_checkpoint(opts.save_dir, tag=f"step{opts.steps}", client_state={"step": opts.steps})
    bar.close()

    peaks = torch.tensor([peak_memory_bytes(device)], dtype=torch.float64, device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    impl = model.config._attn_implementation
    state = upipe_state(model)
    record.update(
        world_size=world,
        sequence_parallel_size=sp,
        upipe_enabled=engine.upipe_settings.upipe.enabled,
        head_chunk_size=engine.upipe_head_chunk_size,
        zero_stage=engine.zero_optimization_stage(),
        train_batch_size=engine.train_batch_size(),
        seq_len=opts.seq_len,
        upipe_stage_runs=state.stage_runs[0] if state is not None else 0,
        attention_function=getattr(ALL_ATTENTION_FUNCTIONS.get(impl), "__qualname__", str(impl)),
        peak_memory_bytes=int(peaks.item()),
        peak_memory_kind="cuda_max_allocated" if device.type == "cuda" else "max_rss",
        # --measure_activations: the first micro-step's forward + backward, the bytes it allocated
        activation_peak_bytes=activation_peak,
        activation_peak_kind=None
        if activation_peak is None
        else ("cuda_allocated_above_pre_step" if device.type == "cuda" else "cpu_peak_rss_above_pre_step"),
        upipe_fused=state.fused_projections if state is not None else None,
        upipe_ring_size=state.ring_size if state is not None else 1,
        # packed rows: documents per row UPipe attended in the last forward (None: one per row, or no UPipe)
        upipe_documents=None
        if state is None or state.last_documents_per_row is None
        else list(state.last_documents_per_row),
        long_context=long_context_record(model),
        checkpointing=engine.upipe_checkpointing,
        # upipe.checkpoint_groups / checkpoint_pairs: the groups installed and how many group backwards ran
        checkpoint_pairs=[group.backward_runs for group in getattr(model, "upipe_checkpoint_groups", [])],
        init_s=init_s,
        wall_s=time.perf_counter() - t_run,
        resumed_from=start,
    )
    if rank == 0:
        mean_tok_s = sum(record["tokens_per_s"]) / max(1, len(record["tokens_per_s"]))
        print(
            f"[{record['name']}] sp={sp} upipe={record['upipe_enabled']} U={record['head_chunk_size']} "
            f"zero={record['zero_stage']}: final loss {record['losses'][-1] if record['losses'] else math.nan:.6f}, "
            f"{mean_tok_s:.0f} tok/s, peak memory {record['peak_memory_bytes'] / 2**30:.2f} GiB "
            f"({record['peak_memory_kind']})",
            flush=True,
        )
    end_iteration(data, loader)
    engine.destroy()
    del engine, model, loader, data
    gc.collect()
    return record


def main(argv: list[str] | None = None) -> int:
    """Run the configured runs; return the exit code (2 after a configuration error)."""
    opts = parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        # CPU run: share the cores between the local ranks instead of oversubscribing them
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    runs = [{"name": "run"}]
    if opts.runs:
        with open(opts.runs, encoding="utf-8") as f:
            runs = json.load(f)
    records, error = [], None
    try:
        for run in runs:
            run_opts = argparse.Namespace(**{**vars(opts), **run})
            records.append(train(run_opts))
    except ValueError as err:  # a configuration error: report it (every rank raises the same one)
        error = str(err)
        print(f"rank {os.environ.get('RANK', '0')}: ValueError: {error}", flush=True)
        if os.environ.get("RANK", "0") == "0":
            traceback.print_exc()
    if opts.metrics_out and int(os.environ.get("RANK", "0")) == 0:
        with open(opts.metrics_out, "w", encoding="utf-8") as f:
            json.dump({"runs": records, "error": error}, f, indent=1)
    return 2 if error is not None else 0


if __name__ == "__main__":
    from ds_upipe import exit_process

    exit_process(main())  # destroys the process groups; no gloo race at interpreter finalization
