#!/usr/bin/env python
"""Train a Llama-family model with ``accelerate launch``, DeepSpeed ZeRO-3 and UPipe sequence parallelism.

    accelerate launch --config_file examples/accelerate_config.yaml examples/train_accelerate.py

The accelerate config names the ds_config (``deepspeed_config_file``, with the ``"upipe"`` block) and
the sequence-parallel size (its ``parallelism_config:`` block, or ``--parallelism_config_sp_size``);
the one line of ds_upipe code is ``hf_integration.enable()``.  This is accelerate's own ALST recipe:
``accelerator.prepare`` shards the data loaders over the sequence ranks and each rank computes the
loss of the whole sequence from its shard (transformers' ``deepspeed_sp_compute_loss``).  With
``--deepspeed_config_file examples/ds_config_alst.json`` (``"upipe": {"enabled": false}``) the same
script runs DeepSpeed ALST's Ulysses; with ``--num_processes 1 --parallelism_config_sp_size 1`` it
runs without sequence parallelism.

Runs on CPU (float32, gloo: ``PartialState(cpu=True)`` before ``Accelerator()``) and on GPU without
changes.  ``--metrics_out`` writes the per-step losses, the eval loss and the UPipe stage counts as JSON.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from tiny_llama import RandomTokens, report_metrics, stage_runs_per_rank, tiny_llama_config, watch_long_context

CPU = not torch.cuda.is_available()
if CPU:
    # DeepSpeed's CPU accelerator (gloo); must precede `import deepspeed`
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_len", type=int, default=64, help="tokens per sequence (a multiple of the sp size)")
    p.add_argument("--train_samples", type=int, default=12)
    p.add_argument("--eval_samples", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics_out", default=None, help="JSON file for losses and UPipe stage counts (rank 0)")
    return p.parse_args()


def lm_loss(accelerator, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:  # noqa: ANN001
    """(loss of the whole sequence, its number of target tokens).  Under DeepSpeed sequence parallelism
    the batch is this rank's shard with pre-shifted ``shift_labels``; the loss is accelerate's recipe."""
    pc = accelerator.parallelism_config
    if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled:
        from deepspeed.utils import groups
        from transformers.integrations.deepspeed import deepspeed_sp_compute_loss

        tokens = (batch["shift_labels"] != -100).sum()
        torch.distributed.all_reduce(tokens, group=groups._get_sequence_parallel_group())
        return deepspeed_sp_compute_loss(accelerator, model, batch, False, pc), int(tokens)
    return model(**batch).loss, int((batch["labels"][:, 1:] != -100).sum())


def main() -> None:
    opts = parse_args()
    from accelerate import Accelerator, PartialState
    from transformers import LlamaForCausalLM

    from ds_upipe import hf_integration
    from ds_upipe.pipeline import StageCounter

    hf_integration.enable()  # the one line: UPipe (or ALST) from the ds_config's "upipe" block
    stages = StageCounter().start()  # UPipe stages run in this process (0 under ALST)

    if CPU:
        PartialState(cpu=True)  # gloo on CPU; must come before Accelerator()
    accelerator = Accelerator()
    torch.manual_seed(opts.seed)
    config = tiny_llama_config(opts.seq_len)
    model = LlamaForCausalLM(config)
    long_context = watch_long_context(model)  # the ds_config's tiled_* keys: the stack, and no full logits
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    train = RandomTokens(opts.train_samples, opts.seq_len, config.vocab_size, seed=opts.seed + 1)
    evaluation = RandomTokens(opts.eval_samples, opts.seq_len, config.vocab_size, seed=opts.seed + 2)
    train_loader = torch.utils.data.DataLoader(train, batch_size=1, shuffle=False)
    eval_loader = torch.utils.data.DataLoader(evaluation, batch_size=1, shuffle=False)
    # under sequence parallelism both loaders come back sharded over the sequence ranks
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    start = time.perf_counter()
    losses: list[float] = []
    grad_norms: list[float] = []
    model.train()
    for batch in train_loader:
        loss, _ = lm_loss(accelerator, model, batch)
        accelerator.backward(loss)  # with DeepSpeed this also runs the engine's optimizer step
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        grad_norms.append(float(model.get_global_grad_norm()))  # the DeepSpeed engine's, before clipping
        if len(losses) == opts.steps:
            break
    train_stages = stages.count

    # Eval loss = token-weighted mean over the eval set.  Every rank of a sequence group holds the same
    # (loss, tokens) of the group's batch, so summing over all ranks counts each batch sp times over.
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    eval_lengths = set()
    with torch.no_grad():
        for batch in eval_loader:
            eval_lengths.add(batch["input_ids"].shape[1])
            loss, tokens = lm_loss(accelerator, model, batch)
            total += torch.tensor([loss.item() * tokens, tokens], dtype=torch.float64)
    total = accelerator.reduce(total.to(accelerator.device), reduction="sum").cpu()
    eval_loss = (total[0] / total[1]).item()
    wall = time.perf_counter() - start

    stage_runs = stage_runs_per_rank(train_stages, stages.count)
    pc = accelerator.parallelism_config
    result = {
        "world_size": accelerator.num_processes,
        "sp_size": pc.sp_size if pc is not None else 1,
        "upipe_block": accelerator.state.deepspeed_plugin.deepspeed_config.get("upipe"),
        "train_losses": losses,
        "grad_norms": grad_norms,
        "eval_loss": eval_loss,
        **stage_runs,
        "eval_local_seq_lens": sorted(eval_lengths),
        "long_context": long_context(),
        "wall_s": wall,
    }
    report_metrics(result, opts.metrics_out, accelerator.is_main_process)
    accelerator.end_training()


if __name__ == "__main__":
    from ds_upipe import exit_process

    main()
    exit_process(0)  # success: exit 0 without the gloo race of interpreter finalization (see its docstring)
