"""TRL's DPOTrainer built and trained as a TRL user would, under ``hf_integration.enable()``
(torchrun; tests/test_rl.py launches it).  ``--trainer trl``: TRL's own DPOTrainer; with ``--sp_size 2``
ds_upipe must refuse it by name on every rank before any collective of the training loop (each rank
prints ``REFUSED: <message>`` and exits 3); with ``--sp_size 1`` it trains.  ``--trainer sp``:
``ds_upipe.integration.trl_dpo.SequenceParallelDPOTrainer``, which trains under SP.  ``--metrics_out``:
the logged losses, gradient norms, rewards and log-probs, and the UPipe stages this rank ran."""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sp_size", type=int, default=2)
    p.add_argument("--output_dir", default="/tmp/ds_upipe_trl_dpo")
    p.add_argument("--trainer", choices=["trl", "sp"], default="trl", help="sp: ds_upipe's SequenceParallelDPOTrainer")
    p.add_argument("--metrics_out", default=None)
    p.add_argument("--eager", action="store_true")
    opts = p.parse_args()
    from datasets import Dataset
    from sft_trl import random_texts, word_tokenizer
    from tiny_llama import report_metrics, sequence_parallelism, tiny_llama_config
    from transformers import LlamaForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from ds_upipe import hf_integration
    from ds_upipe.pipeline import StageCounter

    hf_integration.enable()
    stages = StageCounter().start()
    args = DPOConfig(
        output_dir=opts.output_dir,
        deepspeed="examples/ds_config_upipe.json",
        parallelism_config=sequence_parallelism(opts.sp_size),
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        beta=0.5,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataset_num_proc=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(64))
    if opts.eager:  # another float32 rounding of the same attention (sizes the float32 noise of the comparison)
        model.set_attn_implementation("eager")
    vocab = model.config.vocab_size
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    n = 8
    data = Dataset.from_dict(
        {
            "prompt": random_texts(n, vocab, 8, 1),
            "chosen": [" " + t for t in random_texts(n, vocab, 8, 2)],
            "rejected": [" " + t for t in random_texts(n, vocab, 8, 3)],
        }
    )
    # a model built from a config has no path TRL could load the reference from: pass a copy
    logged: list[dict[str, float]] = []

    class RecordLogs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            if logs and "loss" in logs:
                logged.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    cls = DPOTrainer
    if opts.trainer == "sp":
        from ds_upipe.integration.trl_dpo import SequenceParallelDPOTrainer as cls
    trainer = cls(
        model=model,
        callbacks=[RecordLogs()],
        ref_model=copy.deepcopy(model),
        args=args,
        train_dataset=data,
        processing_class=word_tokenizer(vocab),
    )
    try:
        trainer.train()
    except ValueError as err:
        print(f"REFUSED: {err}", flush=True)
        return 3
    keys = (
        "loss",
        "grad_norm",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    )
    record = {k: [r[k] for r in logged] for k in keys}
    record["stage_runs"] = stages.count
    report_metrics(record, opts.metrics_out, torch.distributed.get_rank() == 0)
    return 0


if __name__ == "__main__":
    from ds_upipe import exit_process

    exit_process(main())
