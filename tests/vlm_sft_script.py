"""TRL's SFTTrainer on a tiny Qwen2.5-VL (float32, tests/vlm_cases.py) under ``hf_integration.enable()``, as a TRL
user would run it (torchrun; tests/test_trl.py launches it with ``--sp_size 2`` and, as the reference, 1 process
with ``--sp_size 1``).  No processor is built (none can be offline): the samples are made here, already tokenized
(``input_ids`` with the image placeholders expanded, random pixel patches, ``image_grid_thw``), and a collator of
this script pads them per batch (TRL's dynamic padding: rows of different lengths) into ``input_ids``,
``attention_mask``, ``labels`` (-100 on the images and the padding), ``mm_token_type_ids``, ``pixel_values`` and
``image_grid_thw``.  ``--metrics_out``: every logged entry, the eval metrics and the UPipe stages each rank ran."""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "examples")]
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

from tiny_llama import report_metrics, sequence_parallelism, stage_runs_per_rank  # noqa: E402

from tests.vlm_cases import IMAGE, build_qwen2_5_vl  # noqa: E402

#: image grids (t, h, w in patches; spatial merge 2: h * w / 4 tokens) a sample draws from
GRIDS = ([1, 4, 4], [1, 4, 8])
PATCH = 3 * 2 * 2  # channels x temporal patch x patch x patch of build_qwen2_5_vl's tower


def samples(n: int, seed: int) -> list[dict]:
    """``n`` samples of 1 or 2 images placed among 6 to 24 random text tokens."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        grids = [rng.choice(GRIDS) for _ in range(rng.randint(1, 2))]
        ids: list[int] = []
        for grid in grids:
            ids += [rng.randrange(3, 100) for _ in range(rng.randint(1, 6))] + [IMAGE] * (grid[1] * grid[2] // 4)
        ids += [rng.randrange(3, 100) for _ in range(rng.randint(4, 12))]
        patches = sum(g[0] * g[1] * g[2] for g in grids)
        out.append(
            {
                "input_ids": ids,
                "image_grid_thw": grids,
                "pixel_values": torch.randn(patches, PATCH, generator=gen).tolist(),
            }
        )
    return out


def collate(batch: list[dict]) -> dict[str, torch.Tensor]:
    """Rows padded at the end to the batch's longest (pad id 0, labels -100); the images concatenated."""
    longest = max(len(s["input_ids"]) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s["input_ids"])] = torch.tensor(s["input_ids"])
        mask[row, : len(s["input_ids"])] = 1
    labels = ids.masked_fill((ids == IMAGE) | (mask == 0), -100)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "mm_token_type_ids": (ids == IMAGE).long(),
        "pixel_values": torch.cat([torch.tensor(s["pixel_values"]) for s in batch]),
        "image_grid_thw": torch.tensor([g for s in batch for g in s["image_grid_thw"]]),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sp_size", type=int, default=2)
    p.add_argument("--deepspeed", default="examples/ds_config_upipe.json")
    p.add_argument("--output_dir", default="/tmp/ds_upipe_vlm_sft")
    p.add_argument("--metrics_out", default=None)
    p.add_argument("--steps", type=int, default=3)
    opts = p.parse_args()
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from ds_upipe import hf_integration
    from ds_upipe.pipeline import StageCounter

    hf_integration.enable()
    stages = StageCounter().start()
    model = build_qwen2_5_vl().float()  # before SFTConfig: its ZeRO-3 would partition it as it is built
    args = SFTConfig(
        output_dir=opts.output_dir,
        deepspeed=opts.deepspeed,
        parallelism_config=sequence_parallelism(opts.sp_size),
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=1,
        eval_strategy="steps",
        eval_steps=2,
        max_steps=opts.steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        max_length=None,
        remove_unused_columns=False,
        dataset_kwargs={"skip_prepare_dataset": True},  # tokenized here: no processor offline
    )
    logged: list[dict[str, float]] = []

    class RecordLogs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs:
                logged.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast  # TRL wants a processing class; never called on text here

    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, model.config.text_config.vocab_size)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")))
    tokenizer.pad_token = "<pad>"
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(samples(12, 1)),
        eval_dataset=Dataset.from_list(samples(4, 2)),
        processing_class=tokenizer,
        data_collator=collate,
        callbacks=[RecordLogs()],
    )
    trainer.train()
    train_stages = stages.count
    metrics = trainer.evaluate()
    steps = [r for r in logged if "loss" in r]
    result = {
        "world_size": torch.distributed.get_world_size(),
        "sp_size": opts.sp_size,
        "logs": logged,
        "train_losses": [r["loss"] for r in steps],
        "eval_loss": metrics["eval_loss"],
        **stage_runs_per_rank(train_stages, stages.count),
    }
    report_metrics(result, opts.metrics_out, torch.distributed.get_rank() == 0)
    trainer.end()


if __name__ == "__main__":
    from ds_upipe import exit_process

    main()
    exit_process(0)
