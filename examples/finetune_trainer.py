#!/usr/bin/env python
"""Fine-tune a Llama-family model with the HF Trainer, DeepSpeed ZeRO-3 and UPipe sequence parallelism.

    torchrun --nproc_per_node 2 examples/finetune_trainer.py \
        --deepspeed examples/ds_config_upipe.json --sp_size 2

The ds_config's ``"upipe"`` block turns UPipe on (``examples/ds_config_alst.json``, with
``"upipe": {"enabled": false}``, runs DeepSpeed ALST's Ulysses instead); the sequence-parallel size is
the usual ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)``; the one line of ds_upipe code is
``hf_integration.enable()``.  ``--sp_size 1`` trains without sequence parallelism.

By default the model is a tiny Llama built from a config and the data are random tokens (nothing is
downloaded); ``--model PATH`` fine-tunes a local HF checkpoint instead (with ZeRO-3 it is loaded
under ``deepspeed.zero.Init``, already partitioned, so ``TrainingArguments`` comes first), e.g. a
sparse MoE model (Qwen3-MoE, Mixtral; GPT-OSS, which has no sdpa, on CPU with
``--attn_implementation gpt_oss_eager --own_eager_attention``).  Runs on
CPU (float32, gloo) and on GPU (bf16) without changes.  ``--metrics_out`` writes the per-step
training losses, the eval loss and how many UPipe stages ran (rank 0) as JSON.

``--packing`` fine-tunes on packed rows instead: random-length documents, ``--docs_per_row`` of them
flattened into one row by transformers' ``DataCollatorWithFlattening`` (position_ids restart at each
document, no attention mask) and padded at the end to ``--seq_len``.  UPipe attends within each
document only (docs/hf_patches.md, "Packed sequences"); so does the non-SP run, whose SDPA mask
transformers builds from the restarting positions.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from tiny_llama import (
    PackedRows,
    RandomDocuments,
    RandomTokens,
    register_own_eager_attention,
    report_metrics,
    sequence_parallelism,
    stage_runs_per_rank,
    tiny_llama_config,
    watch_long_context,
)

CPU = not torch.cuda.is_available()
if CPU:
    # DeepSpeed's CPU accelerator (gloo); must precede `import deepspeed`
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", default="examples/ds_config_upipe.json", help="ds_config JSON with the upipe block")
    p.add_argument("--sp_size", type=int, default=2, help="sequence-parallel size (1: no sequence parallelism)")
    p.add_argument("--model", default=None, help="local HF checkpoint (default: a tiny Llama built from a config)")
    p.add_argument(
        "--attn_implementation",
        default="sdpa",
        help="the model's attention implementation, also accelerate's sp_attn_implementation",
    )
    p.add_argument(
        "--own_eager_attention",
        action="store_true",
        help="register the --model's own eager attention (its modeling file's eager_attention_forward) under the "
        "name --attn_implementation: for models without sdpa (GPT-OSS, whose eager applies its sinks) on CPU, "
        "where accelerate refuses 'eager' under sequence parallelism",
    )
    p.add_argument("--seq_len", type=int, default=64, help="tokens per sequence (a multiple of sp_size)")
    p.add_argument("--train_samples", type=int, default=12)
    p.add_argument("--eval_samples", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default="/tmp/ds_upipe_trainer")
    p.add_argument("--metrics_out", default=None, help="JSON file for losses and UPipe stage counts (rank 0)")
    p.add_argument("--packing", action="store_true", help="packed rows of documents (DataCollatorWithFlattening)")
    p.add_argument("--docs_per_row", type=int, default=4, help="with --packing: documents per row (batch size)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args()


def build_model(opts: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    torch.manual_seed(opts.seed)
    if opts.own_eager_attention:
        register_own_eager_attention(opts.model, opts.attn_implementation)
    if opts.model:
        return AutoModelForCausalLM.from_pretrained(
            opts.model, attn_implementation=opts.attn_implementation, dtype=torch.float32
        )
    config = tiny_llama_config(opts.seq_len)
    config._attn_implementation = opts.attn_implementation
    return LlamaForCausalLM(config)


def main() -> None:
    opts = parse_args()
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ds_upipe import hf_integration
    from ds_upipe.pipeline import StageCounter

    hf_integration.enable()  # the one line: UPipe (or ALST) from the ds_config's "upipe" block
    stages = StageCounter().start()  # UPipe stages run in this process (0 under ALST)

    parallelism = sequence_parallelism(opts.sp_size, opts.attn_implementation)
    args = TrainingArguments(
        output_dir=opts.output_dir,
        deepspeed=opts.deepspeed,
        parallelism_config=parallelism,
        use_cpu=CPU,
        bf16=not CPU,
        # with --packing a batch of documents is one packed row
        per_device_train_batch_size=opts.docs_per_row if opts.packing else 1,
        per_device_eval_batch_size=opts.docs_per_row if opts.packing else 1,
        max_steps=opts.steps,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=opts.seed,
        disable_tqdm=True,
    )
    model = build_model(opts)
    vocab = model.config.vocab_size
    collator = None
    if opts.packing:  # documents of up to seq_len / docs_per_row tokens: a row's documents always fit
        max_len, per_row = opts.seq_len // opts.docs_per_row, opts.docs_per_row
        train = RandomDocuments(opts.train_samples * per_row, max_len, vocab, seed=opts.seed + 1)
        evaluation = RandomDocuments(opts.eval_samples * per_row, max_len, vocab, seed=opts.seed + 2)
        collator = PackedRows(opts.seq_len)
    else:
        train = RandomTokens(opts.train_samples, opts.seq_len, vocab, seed=opts.seed + 1)
        evaluation = RandomTokens(opts.eval_samples, opts.seq_len, vocab, seed=opts.seed + 2)

    losses: list[float] = []
    grad_norms: list[float] = []

    class RecordLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                grad_norms.append(float(logs["grad_norm"]))

    # what the model sees in evaluation: the local sequence length of each eval batch
    eval_lengths: list[int] = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: None if module.training else eval_lengths.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True,
    )

    # with --packing: how many documents UPipe attended per row (its report of the last attention call)
    documents_per_row: set[int] = set()

    def count_documents(module, args, kwargs, output) -> None:  # noqa: ANN001
        from hf_patches import upipe_state

        state = upipe_state(model)
        if state is not None and state.last_documents_per_row is not None:
            documents_per_row.update(state.last_documents_per_row)

    model.model.register_forward_hook(count_documents, with_kwargs=True)

    long_context = watch_long_context(model)  # the ds_config's tiled_* keys: the stack, and no full logits
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=collator,
        callbacks=[RecordLoss()],
    )
    start = time.perf_counter()
    trainer.train()
    train_stages = stages.count
    metrics = trainer.evaluate()
    wall = time.perf_counter() - start

    from hf_patches import upipe_state

    state = upipe_state(model)
    stage_runs = stage_runs_per_rank(train_stages, stages.count)
    result = {
        "world_size": torch.distributed.get_world_size(),
        "sp_size": opts.sp_size,
        "packing": opts.packing,
        "ds_config": opts.deepspeed,
        "train_losses": losses,
        "grad_norms": grad_norms,
        "eval_loss": metrics["eval_loss"],
        **stage_runs,
        "upipe": None
        if state is None
        else {"fused": state.fused_projections, "head_chunk_size": state.head_chunk_size},
        "eval_local_seq_lens": sorted(set(eval_lengths)),
        "upipe_documents_per_row": sorted(documents_per_row),
        "long_context": long_context(),
        # blocks ZeRO-3 gathers whole, once per call (the tiled MLP marks sparse MoE blocks so)
        "z3_leaf_modules": sorted({type(m).__name__ for m in model.modules() if getattr(m, "_z3_leaf", False)}),
        "wall_s": wall,
    }
    report_metrics(result, opts.metrics_out, torch.distributed.get_rank() == 0)
    trainer.end()


if __name__ == "__main__":
    from ds_upipe import exit_process

    main()
    exit_process(0)  # success: exit 0 without the gloo race of interpreter finalization (see its docstring)
