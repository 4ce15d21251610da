"""TRL's DPOTrainer built and trained as a TRL user would, under ``hf_integration.enable()``
(torchrun; tests/test_rl.py launches it).  With ``--sp_size 2`` ds_upipe must refuse it by name on every
rank before any collective of the training loop; each rank prints ``REFUSED: <message>`` and exits 3.
With ``--sp_size 1`` it trains (exit 0)."""

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
    opts = p.parse_args()
    from datasets import Dataset
    from sft_trl import random_texts, word_tokenizer
    from tiny_llama import sequence_parallelism, tiny_llama_config
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    from ds_upipe import hf_integration

    hf_integration.enable()
    args = DPOConfig(
        output_dir=opts.output_dir,
        deepspeed="examples/ds_config_upipe.json",
        parallelism_config=sequence_parallelism(opts.sp_size),
        use_cpu=not torch.cuda.is_available(),
        per_device_train_batch_size=2,
        max_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataset_num_proc=None,
    )
    model = LlamaForCausalLM(tiny_llama_config(64))
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
    trainer = DPOTrainer(
        model=model,
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
    return 0


if __name__ == "__main__":
    from ds_upipe import exit_process

    exit_process(main())
