#!/usr/bin/env python
"""Supervised fine-tuning with TRL's ``SFTTrainer``, DeepSpeed ZeRO-3 and UPipe sequence parallelism.

    torchrun --nproc_per_node 2 examples/sft_trl.py --deepspeed examples/ds_config_upipe.json --sp_size 2

What a TRL user changes: the ds_config gets a ``"upipe"`` block (``examples/ds_config_upipe.json``),
``SFTConfig`` the usual ``parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N)``,
and the script one line, ``hf_integration.enable()``, before the trainer is built.  Everything else
is TRL as it ships: its collators (dynamic padding, ``packing=True``, ``padding_free=True``), its
fused LM head, loss and metrics.  Under ``enable()`` the training loss (also with gradient
accumulation), ``eval_loss`` and TRL's ``mean_token_accuracy`` / ``entropy`` equal the run without
sequence parallelism (``--sp_size 1``); see docs/trainer_accelerate.md, "TRL".

``--data``: ``plain`` (text of random lengths, padded per batch), ``prompt_completion`` (loss on the
completion only), ``packing`` (TRL's best-fit-decreasing packing into rows of ``--seq_len``) or
``padding_free`` (a batch of ``--batch_size`` sequences flattened into one row).  The model is a tiny
one built from a config (``--arch``: Llama, or a hybrid such as Qwen3.5 or Nemotron-H, whose linear-attention
/ state-space layers UPipe runs head-sharded), the tokenizer a word-level one built in code: nothing is
downloaded.
``--metrics_out`` writes the logged training metrics, the eval metrics and the UPipe stage counts.
"""

from __future__ import annotations

import argparse
import os
import random

import torch
from tiny_llama import report_metrics, sequence_parallelism, stage_runs_per_rank

CPU = not torch.cuda.is_available()
if CPU:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator (gloo); before `import deepspeed`

from ds_upipe.tools.models import ARCHS, tiny_causal_lm  # noqa: E402 - ds_upipe imports deepspeed: after DS_ACCELERATOR

DATA = ("plain", "prompt_completion", "packing", "padding_free")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed", default="examples/ds_config_upipe.json", help="ds_config JSON with the upipe block")
    p.add_argument(
        "--arch",
        choices=list(ARCHS),
        default="llama",
        help="the tiny model's architecture (ds_upipe.tools.models: llama; hybrids such as qwen3_5, nemotron_h)",
    )
    p.add_argument("--sp_size", type=int, default=2, help="sequence-parallel size (1: no sequence parallelism)")
    p.add_argument("--data", choices=DATA, default="plain")
    p.add_argument("--seq_len", type=int, default=64, help="SFTConfig.max_length (and the packed row length)")
    p.add_argument("--batch_size", type=int, default=2, help="per-device batch size")
    p.add_argument(
        "--eval_batch_size", type=int, default=None, help="per-device eval batch size (default: --batch_size)"
    )
    p.add_argument(
        "--eval_steps", type=int, default=None, help="evaluate every N steps as well (default: at the end only)"
    )
    p.add_argument("--pad_to_multiple_of", type=int, default=None, help="SFTConfig.pad_to_multiple_of")
    p.add_argument("--grad_accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--train_samples", type=int, default=24)
    p.add_argument("--eval_samples", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init_std", type=float, default=None, help="the model's initializer_range (default: its own)")
    p.add_argument("--output_dir", default="/tmp/ds_upipe_sft_trl")
    p.add_argument("--metrics_out", default=None, help="JSON file for the metrics (rank 0)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def word_tokenizer(vocab_size: int):  # noqa: ANN201 - transformers' fast tokenizer
    """A word-level tokenizer of ``vocab_size`` ids: ``<pad>``, ``<eos>`` and the words w0, w1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(vocab_size - 2)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def random_texts(n: int, vocab_size: int, max_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(vocab_size - 2)}" for _ in range(rng.randint(2, max_words))) for _ in range(n)]


def dataset(kind: str, n: int, vocab_size: int, seq_len: int, seed: int):  # noqa: ANN201 - a datasets.Dataset
    from datasets import Dataset

    if kind == "prompt_completion":
        prompts = random_texts(n, vocab_size, seq_len // 3, seed)
        completions = random_texts(n, vocab_size, seq_len // 3, seed + 100)
        return Dataset.from_dict({"prompt": prompts, "completion": completions})
    # packing: documents short enough that several share a row; otherwise up to a full row
    max_words = seq_len // 4 if kind == "packing" else seq_len - 1
    return Dataset.from_dict({"text": random_texts(n, vocab_size, max_words, seed)})


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(argv)
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from ds_upipe import hf_integration
    from ds_upipe.pipeline import StageCounter

    hf_integration.enable()  # the one line: UPipe (or ALST) from the ds_config's "upipe" block
    stages = StageCounter().start()  # UPipe stages run in this process (0 under ALST or without SP)

    parallelism = sequence_parallelism(opts.sp_size)
    args = SFTConfig(
        output_dir=opts.output_dir,
        deepspeed=opts.deepspeed,
        parallelism_config=parallelism,
        use_cpu=CPU,
        bf16=not CPU,
        per_device_train_batch_size=opts.batch_size,
        per_device_eval_batch_size=opts.eval_batch_size or opts.batch_size,
        eval_strategy="steps" if opts.eval_steps else "no",
        eval_steps=opts.eval_steps,
        gradient_accumulation_steps=opts.grad_accum,
        max_steps=opts.steps,
        learning_rate=opts.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=opts.seed,
        disable_tqdm=True,
        # padding-free rows are the batch's sequences end to end (TRL enforces no max_length there;
        # the samples are shorter than --seq_len)
        max_length=None if opts.data == "padding_free" else opts.seq_len,
        packing=opts.data == "packing",
        padding_free=opts.data == "padding_free",
        pad_to_multiple_of=opts.pad_to_multiple_of,
        dataset_num_proc=None,
    )
    torch.manual_seed(opts.seed)
    init = {} if opts.init_std is None else {"initializer_range": opts.init_std}
    model = tiny_causal_lm(opts.arch, max_position_embeddings=opts.seq_len, **init)
    vocab = model.config.vocab_size
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    tokenizer = word_tokenizer(vocab)

    logged: list[dict[str, float]] = []  # every log entry: training steps, evaluations, the run's summary

    class RecordLogs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs:
                logged.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset(opts.data, opts.train_samples, vocab, opts.seq_len, opts.seed + 1),
        eval_dataset=dataset(opts.data, opts.eval_samples, vocab, opts.seq_len, opts.seed + 2),
        processing_class=tokenizer,
        callbacks=[RecordLogs()],
    )
    trainer.train()
    train_stages = stages.count
    metrics = trainer.evaluate()
    steps = [r for r in logged if "loss" in r]

    from hf_patches import long_context_stack

    stack = long_context_stack(model)
    stage_runs = stage_runs_per_rank(train_stages, stages.count)
    result = {
        "world_size": torch.distributed.get_world_size(),
        "sp_size": opts.sp_size,
        "arch": opts.arch,
        "data": opts.data,
        "grad_accum": opts.grad_accum,
        "ds_config": opts.deepspeed,
        "logs": logged,
        "train_losses": [r["loss"] for r in steps],
        "grad_norms": [r["grad_norm"] for r in steps],
        "train_mean_token_accuracy": [r["mean_token_accuracy"] for r in steps],
        "train_entropy": [r["entropy"] for r in steps],
        "eval_loss": metrics["eval_loss"],
        "eval_mean_token_accuracy": metrics["eval_mean_token_accuracy"],
        "eval_entropy": metrics["eval_entropy"],
        "long_context": None
        if stack is None
        else {k: getattr(stack, k) for k in ("tiled_loss", "tiled_norm", "tiled_mlp")},
        **stage_runs,
    }
    report_metrics(result, opts.metrics_out, torch.distributed.get_rank() == 0)
    trainer.end()


if __name__ == "__main__":
    from ds_upipe import exit_process

    main()
    exit_process(0)  # success: exit 0 without the gloo race of interpreter finalization (see its docstring)
