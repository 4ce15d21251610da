#!/usr/bin/env python
"""DPO and GRPO-style training under UPipe sequence parallelism, with a DeepSpeed engine.

    torchrun --nproc_per_node 2 examples/rl_sp.py --sp_size 2 --algo dpo    # UPipe, SP 2, ZeRO-3
    torchrun --nproc_per_node 1 examples/rl_sp.py --sp_size 1 --algo dpo    # the same without SP

(``--algo grpo`` for the GRPO-style loop, ``--algo both`` for DPO then GRPO.)  Both runs print the
same per-step losses and gradient norms (float32, to about 1e-6).  On a machine without GPUs this
runs on the CPU over gloo.

TRL's DPOTrainer / GRPOTrainer compute their losses from whole sequences, so under sequence
parallelism ds_upipe refuses them (DPO through TRL: ``ds_upipe.integration.trl_dpo.
SequenceParallelDPOTrainer``); this is the loop of one's own, with the functions of
``hf_patches.rl_loss`` (docs/trainer_accelerate.md, "Preference and RL training under SP"):

- DPO: every rank of the group holds the same preference batch ([chosen; rejected] rows with a
  completion mask, as TRL's collator makes it) and shards it (``shard_completions``); the reference's
  summed log-probs are precomputed with the initial policy before training (TRL's
  ``precompute_ref_log_probs``); ``sequence_parallel_dpo_loss`` gives the DPO loss of the whole rows.
- GRPO-style: completions are sampled *without* sequence parallelism, by an unpatched copy of the
  weights (gathered from ZeRO-3 before each generation); the policy's log-probs of the completions are
  computed on shards (``model_token_logprobs``), old log-probs once per generation, two updates per
  generation, and ``sequence_parallel_grpo_loss`` (TRL's "dapo" normalisation, clipped ratios).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VOCAB = 128


def ds_config(sp_size: int, zero: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        "sequence_parallel_size": sp_size,
        "upipe": {"enabled": True},
    }


def preference_batch(step: int, pairs: int, longest: int) -> dict[str, torch.Tensor]:
    """[chosen; rejected] rows right-padded with a completion mask, as TRL's DataCollatorForPreference
    makes them (random tokens; the same on every rank)."""
    g = torch.Generator().manual_seed(step)

    def ids(n_max: int) -> list[int]:
        return torch.randint(1, VOCAB, (int(torch.randint(1, n_max + 1, (1,), generator=g)),), generator=g).tolist()

    rows, masks = [], []
    prompts = [ids(longest // 2) for _ in range(pairs)]
    for _ in ("chosen", "rejected"):
        for prompt in prompts:
            completion = ids(longest // 2)
            rows.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
    length = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [0] * (length - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (length - len(r)) for r in rows])
    completion_mask = torch.tensor([m + [0] * (length - len(m)) for m in masks])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}


def sync_generation_weights(engine, generator: torch.nn.Module) -> None:
    """Copy the policy's weights into the unpatched generation model (gathered under ZeRO-3)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():
        for p, q in zip(params, generator.parameters()):
            q.copy_(p.detach())


def sample_completions(generator, prompts, prompt_mask, new_tokens: int, step: int, group) -> dict:
    """GRPO's generation, without sequence parallelism: left-padded prompts, right-padded completions
    (mask 0 after the first EOS, token 0 here); sampled on the group's first rank and broadcast."""
    import torch.distributed as dist

    torch.manual_seed(1000 + step)
    out = generator.generate(
        input_ids=prompts, attention_mask=prompt_mask, max_new_tokens=new_tokens, do_sample=True,
        pad_token_id=0, eos_token_id=0, min_new_tokens=1,
    )  # fmt: skip
    completion = out[:, prompts.shape[1] :].contiguous()
    completion = torch.nn.functional.pad(completion, (0, new_tokens - completion.shape[1]))
    if group is not None:
        dist.broadcast(completion, src=dist.get_global_rank(group, 0), group=group)
    is_eos = (completion == 0).int()
    # TRL: the completion mask covers the tokens up to and including the first EOS
    first_eos = torch.where(is_eos.any(1), is_eos.argmax(1), torch.full_like(is_eos[:, 0], new_tokens))
    mask = (torch.arange(new_tokens).unsqueeze(0) <= first_eos.unsqueeze(1)).int()
    return {"completion_ids": completion, "completion_mask": mask}


def rewards_of(completion: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A toy reward: the share of completion tokens with an even id."""
    return ((completion % 2 == 0) & mask.bool()).sum(1) / mask.sum(1).clamp(min=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--algo", choices=["dpo", "grpo", "both"], default="dpo", help="both: DPO, then GRPO")
    parser.add_argument("--sp_size", type=int, default=2)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq_len", type=int, default=32, help="longest prompt + completion (tokens)")
    parser.add_argument("--metrics_out", default=None)
    opts = parser.parse_args()

    import deepspeed
    import torch.distributed as dist
    from tiny_llama import report_metrics, tiny_llama_config
    from transformers import LlamaForCausalLM

    import ds_upipe
    from hf_patches import rl_loss, upipe_state
    from hf_patches.logprobs import model_token_logprobs

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(2 * opts.seq_len))
    generator = copy.deepcopy(model).eval()  # unpatched: generation runs without sequence parallelism
    engine, *_ = ds_upipe.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config(opts.sp_size, opts.zero)
    )
    group = engine.seq_parallel_group if opts.sp_size > 1 else None
    record = {
        "sp_size": opts.sp_size,
        "world_size": dist.get_world_size(),
        **{algo: {"losses": [], "grad_norms": []} for algo in ("dpo", "grpo") if opts.algo in (algo, "both")},
    }

    def update(loss: torch.Tensor, algo: str) -> None:
        engine.backward(loss)
        engine.step()
        record[algo]["losses"].append(loss.item())
        record[algo]["grad_norms"].append(float(engine.get_global_grad_norm()))

    if "dpo" in record:
        shards = [rl_loss.shard_completions(preference_batch(s, 2, opts.seq_len), group) for s in range(opts.steps)]
        with torch.no_grad():  # the reference: the initial policy, precomputed (TRL's precompute_ref_log_probs)
            refs = [rl_loss.completion_logps(engine, shard, group)[0].chunk(2) for shard in shards]
        for shard, ref in zip(shards, refs):
            update(rl_loss.sequence_parallel_dpo_loss(engine, shard, group, ref_logps=ref, beta=0.1).loss, "dpo")
    if "grpo" in record:
        rows, prompt_len, new_tokens = 4, opts.seq_len // 2, opts.seq_len // 2
        for step in range(opts.steps):
            g = torch.Generator().manual_seed(step)
            prompts = torch.randint(1, VOCAB, (rows // 2, prompt_len), generator=g).repeat_interleave(2, 0)
            prompt_mask = torch.ones_like(prompts)
            prompt_mask[0::2, : step % 3] = 0  # some left padding, as TRL's tokenizer gives
            prompts = prompts.masked_fill(prompt_mask == 0, 0)
            sync_generation_weights(engine, generator)
            sample = sample_completions(generator, prompts, prompt_mask, new_tokens, step, group)
            rewards = rewards_of(sample["completion_ids"], sample["completion_mask"]).view(-1, 2)
            advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).view(-1)
            batch = rl_loss.completion_rows(prompts, prompt_mask, sample["completion_ids"], sample["completion_mask"])
            shard = rl_loss.shard_completions(batch, group)
            with torch.no_grad():
                old = model_token_logprobs(engine, shard)
            for _ in range(2):  # TRL's num_iterations=2: the second update's ratios differ from 1
                logps = model_token_logprobs(engine, shard)
                loss = rl_loss.sequence_parallel_grpo_loss(
                    logps, shard["shift_labels"], advantages, group, old_token_logps=old, epsilon_low=0.2,
                    epsilon_high=0.28, loss_type="dapo", num_items_in_batch=sample["completion_mask"].sum(),
                )  # fmt: skip
                update(loss, "grpo")
    state = upipe_state(engine.module)  # UPipe's stages ran on this rank (0 without SP)
    record["stage_runs"] = 0 if state is None else state.stage_runs[0]
    report_metrics(record, opts.metrics_out, dist.get_rank() == 0)


if __name__ == "__main__":
    from ds_upipe import exit_process

    main()
    exit_process(0)  # success: exit 0 without the gloo race of interpreter finalization (see its docstring)
