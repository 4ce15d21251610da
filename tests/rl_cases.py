"""Rank-side bodies of tests/test_rl.py: DPO and GRPO under UPipe (hf_patches.rl_loss) against TRL's
non-SP definitions on the whole rows, float64, tiny Llama models.

The reference runs in each rank's own process on the unpatched model and the whole batch, the way TRL
computes it: per-token log-probs from TRL's own fused LM head (``trl.trainer.utils.add_fused_lm_head``,
``fused_lm_head=True``), the batch layouts of TRL's collators (``DataCollatorForPreference``; GRPO's
left-padded prompt + right-padded completion), and the loss lines of ``DPOTrainer._compute_loss`` /
``GRPOTrainer._compute_loss`` transcribed below.  The SP side: the policy and a reference model patched
with ``apply_upipe`` (the policy is a ``copy.deepcopy`` of the patched reference), each rank on its
shard; its parameter gradients averaged over the ranks ("mean", as DeepSpeed) must equal the
reference's.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hf_patches
from hf_patches import rl_loss
from hf_patches.logprobs import model_token_logprobs, sequence_logprobs
from tests.hf_cases import build_model, relative_error

VOCAB = 101
F64 = 1e-10
F32 = 1e-5


def _models(seed: int, noise: float = 0.02):
    """(reference unpatched, policy unpatched, reference patched, policy patched): the policy is the
    reference plus noise; the patched policy is a deepcopy of the patched reference given the policy's
    weights (a deepcopy of a patched model must join the same group and work)."""
    ref = build_model("llama", torch.float64, seed=seed, vocab_size=VOCAB)
    policy = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    ref_sp = hf_patches.apply_upipe(copy.deepcopy(ref), dist.group.WORLD)
    policy_sp = copy.deepcopy(ref_sp)
    policy_sp.load_state_dict(policy.state_dict())
    for model in (ref, ref_sp):
        model.requires_grad_(False)
    return ref, policy, ref_sp, policy_sp


def _token_logps(model, input_ids, attention_mask, labels, position_ids=None):
    """Per-token log-probs [batch, seq - 1] of the next-token labels, 0 where -100: what TRL's fused LM
    head returns (``fused_lm_head=True``), here in the model's float64 (TRL's head computes in float32;
    ``_trl_logps`` checks the two agree to float32 precision)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1]
    targets = labels[:, 1:]
    logps = torch.log_softmax(logits, dim=-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return logps.masked_fill(targets == -100, 0.0)


def _trl_logps(model, input_ids, attention_mask, labels):
    """TRL's own per-token log-probs (its fused LM head, added to a copy of the unpatched model)."""
    from trl.trainer.utils import add_fused_lm_head

    fused = copy.deepcopy(model)
    add_fused_lm_head(fused)
    with torch.no_grad():
        return fused(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True).log_probs


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _mean_grads(model, group):
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            dist.all_reduce(g, group=group)
            grads[n] = g / dist.get_world_size(group)
    return grads


def _grad_error(got, want) -> float:
    if set(got) != set(want):
        return float("inf")
    return max(relative_error(got[n], want[n]) for n in want)


# ---------------------------------------------------------------------------------------------------
# DPO


def preference_batch(seed: int, pairs: int, longest: int) -> dict:
    """TRL's DataCollatorForPreference on random prompts/completions of different lengths."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    gen = torch.Generator().manual_seed(seed)

    def ids(low, high):
        n = int(torch.randint(low, high + 1, (1,), generator=gen))
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    examples = [
        {"prompt_ids": ids(2, longest // 2), "chosen_ids": ids(1, longest // 2), "rejected_ids": ids(1, longest // 2)}
        for _ in range(pairs)
    ]
    return DataCollatorForPreference(pad_token_id=0)(examples)


def dpo_reference(ref, policy, batch, beta, loss_type):
    """DPOTrainer._compute_loss (reverse_kl, no ld_alpha) on the whole rows: loss, logps, gradients."""
    policy.zero_grad(set_to_none=True)
    completion_mask = batch["completion_mask"]
    labels = batch["input_ids"].masked_fill(completion_mask == 0, -100)
    logps = _token_logps(policy, batch["input_ids"], batch["attention_mask"], labels).sum(dim=1)
    with torch.no_grad():
        ref_logps = _token_logps(ref, batch["input_ids"], batch["attention_mask"], labels).sum(dim=1)
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
    delta_score = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(beta * delta_score)
    elif loss_type == "hinge":
        per_sequence_loss = torch.relu(1 - beta * delta_score)
    else:  # ipo
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        chosen_avg_score = chosen_logratios / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected_avg_score = rejected_logratios / rejected_mask.sum(dim=1).clamp(min=1.0)
        per_sequence_loss = (chosen_avg_score - rejected_avg_score - 1 / (2 * beta)) ** 2
    loss = per_sequence_loss.mean()
    loss.backward()
    return loss.detach(), logps.detach(), ref_logps, _grads(policy)


def dpo_case(seed, pairs=2, longest=13, beta=0.5, loss_type="sigmoid", precomputed=False, tile_tokens=None):
    group = dist.group.WORLD
    ref, policy, ref_sp, policy_sp = _models(seed)
    batch = preference_batch(seed, pairs, longest)
    want_loss, want_logps, want_ref, want_grads = dpo_reference(ref, policy, batch, beta, loss_type)
    shard = rl_loss.shard_completions(batch, group)
    kwargs = {"ref_logps": want_ref.chunk(2)} if precomputed else {"ref_model": ref_sp}
    out = rl_loss.sequence_parallel_dpo_loss(
        policy_sp, shard, group, beta=beta, loss_type=loss_type, tile_tokens=tile_tokens, **kwargs
    )
    out.loss.backward()
    got_logps = torch.cat([out.chosen_logps, out.rejected_logps]).detach()
    got_ref = torch.cat([out.ref_chosen_logps, out.ref_rejected_logps])
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    trl = _trl_logps(policy, batch["input_ids"], batch["attention_mask"], labels).sum(dim=1)
    return {
        "f32_trl_logps": relative_error(got_logps, trl),
        "loss": relative_error(out.loss.detach(), want_loss),
        "logps": relative_error(got_logps, want_logps),
        "ref_logps": relative_error(got_ref, want_ref),
        "grads": _grad_error(_mean_grads(policy_sp, group), want_grads),
    }


# ---------------------------------------------------------------------------------------------------
# GRPO


def grpo_batch(seed: int, rows: int, prompt_len: int, completion_len: int) -> dict:
    """A GRPO micro-batch as TRL builds it: left-padded prompts, right-padded completions (mask 0 after
    the EOS), advantages per row."""
    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(1, VOCAB, (rows, prompt_len), generator=gen)
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.randint(1, VOCAB, (rows, completion_len), generator=gen)
    completion_mask = torch.ones_like(completion_ids)
    for r in range(rows):
        pad = int(torch.randint(0, prompt_len - 1, (1,), generator=gen))
        prompt_mask[r, :pad] = 0
        prompt_ids[r, :pad] = 0
        end = int(torch.randint(1, completion_len + 1, (1,), generator=gen))
        completion_mask[r, end:] = 0
        completion_ids[r, end:] = 0
    advantages = torch.randn(rows, generator=gen, dtype=torch.float64)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
    }


def _grpo_token_logps(model, batch):
    """GRPOTrainer._get_per_token_logps_and_entropies' log-probs [rows, completion_len]."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    logits_to_keep = batch["completion_ids"].size(1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    # TRL passes no position_ids, so a left-padded row's positions start at its padding; RoPE depends on
    # relative positions only, but transformers computes its angles in float32, so that shift changes the
    # scores at float32 precision.  The positions of the real tokens from 0 (as generate() numbers them)
    # make the float64 comparison exact.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return _token_logps(model, input_ids, attention_mask, labels, position_ids)[:, -logits_to_keep:]


def grpo_reference(policy, old, ref, batch, cfg):
    """GRPOTrainer._compute_loss for one micro-batch (current_gradient_accumulation_steps 1), transcribed."""
    policy.zero_grad(set_to_none=True)
    per_token_logps = _grpo_token_logps(policy, batch)
    with torch.no_grad():
        old_per_token_logps = _grpo_token_logps(old, batch)
        ref_per_token_logps = _grpo_token_logps(ref, batch)
    mask = batch["completion_mask"]
    advantages = batch["advantages"].unsqueeze(1)
    log_ratio = per_token_logps - old_per_token_logps
    if cfg["importance_sampling_level"] == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    beta = cfg["beta"]
    if beta != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
    coef_2 = torch.clamp(coef_1, 1 - cfg["epsilon_low"], 1 + cfg["epsilon_high"])
    if cfg.get("delta") is not None:
        coef_1 = torch.clamp(coef_1, max=cfg["delta"])
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    loss_type = cfg["loss_type"]
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * cfg["max_completion_length"])
    else:  # dapo, one process: num_items_in_batch / num_processes(1)
        loss = (per_token_loss * mask).sum() / torch.as_tensor(cfg["num_items_in_batch"]).clamp(min=1.0)
    loss.backward()
    return loss.detach(), (per_token_logps.detach() * mask).sum(-1), _grads(policy)


def grpo_case(seed, rows=3, prompt_len=7, completion_len=9, **cfg):
    group = dist.group.WORLD
    cfg = {"beta": 0.04, "epsilon_low": 0.02, "epsilon_high": 0.03, "importance_sampling_level": "token", **cfg}
    cfg.setdefault("loss_type", "dapo")
    cfg.setdefault("max_completion_length", completion_len)
    cfg.setdefault("num_items_in_batch", 11.0)
    # old policy: the reference plus other noise (ratios off 1, some clipped); the KL reference: ``ref``
    ref, policy, ref_sp, policy_sp = _models(seed)
    _, old, _, old_sp = _models(seed, noise=0.01)
    batch = grpo_batch(seed, rows, prompt_len, completion_len)
    want_loss, want_row_logps, want_grads = grpo_reference(policy, old, ref, batch, cfg)

    rows_batch = rl_loss.completion_rows(
        batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"]
    )
    shard = rl_loss.shard_completions(rows_batch, group)
    token_logps = model_token_logprobs(policy_sp, shard)
    with torch.no_grad():
        old_logps = model_token_logprobs(old_sp, shard)
        ref_logps = model_token_logprobs(ref_sp, shard)
    row_logps, _ = sequence_logprobs(token_logps.detach(), shard["shift_labels"], group)
    loss = rl_loss.sequence_parallel_grpo_loss(
        token_logps,
        shard["shift_labels"],
        batch["advantages"],
        group,
        old_token_logps=old_logps,
        ref_token_logps=ref_logps,
        beta=cfg["beta"],
        epsilon_low=cfg["epsilon_low"],
        epsilon_high=cfg["epsilon_high"],
        delta=cfg.get("delta"),
        loss_type=cfg["loss_type"],
        importance_sampling_level=cfg["importance_sampling_level"],
        max_completion_length=cfg["max_completion_length"],
        num_items_in_batch=cfg["num_items_in_batch"],
    )
    loss.backward()
    # ratios far enough from 1 to be clipped somewhere in the rows (the shards' largest |log-ratio|)
    clipped = (old_logps - token_logps.detach()).abs().max()
    dist.all_reduce(clipped, op=dist.ReduceOp.MAX, group=group)
    clipped = clipped.item()
    return {
        "loss": relative_error(loss.detach(), want_loss),
        "row_logps": relative_error(row_logps, want_row_logps),
        "grads": _grad_error(_mean_grads(policy_sp, group), want_grads),
        "ratios_clip": float(clipped < 0.05),
    }


# ---------------------------------------------------------------------------------------------------


NUM_CASES = {2: 7, 4: 2}


def check_cases(per_rank: list[dict], world: int) -> None:
    """Every rank's errors within tolerance (the test side of ``cases``)."""
    for rank, cases in enumerate(per_rank):
        assert len(cases) == NUM_CASES[world]
        for case, errors in cases.items():
            for name, error in errors.items():  # f32_: against TRL's own (float32) fused LM head
                tolerance = F32 if name.startswith("f32_") else F64
                assert error <= tolerance, f"C={world} rank {rank} {case} {name}: {errors}"


def in_spawn_of_four(rank: int, world: int) -> dict | None:
    """The C=4 cases for test_hf_parity's spawn of four (None without TRL, whose collator they use)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return None
    return cases(rank, world)["cases"]


def _grpo_sequence():
    return grpo_case(3, loss_type="grpo", importance_sampling_level="sequence", delta=1.02)


def cases(rank, world):
    """{case: errors} for the group of cases run at this world size (one spawn)."""
    if world == 4:  # test time: a subset at C=4 (in test_hf_parity's C=4 spawn)
        return {"cases": {"dpo_sigmoid": dpo_case(0), "grpo_grpo_sequence": _grpo_sequence()}}
    out = {
        "dpo_sigmoid": dpo_case(0),
        "dpo_ipo_precomputed": dpo_case(1, loss_type="ipo", precomputed=True, pairs=3),
        "grpo_dapo_token": grpo_case(2),
        "grpo_grpo_sequence": _grpo_sequence(),
    }
    if world == 2:
        out["dpo_hinge_untiled"] = dpo_case(4, loss_type="hinge", beta=0.05, tile_tokens=10_000)
        out["grpo_bnpo_no_kl"] = grpo_case(5, loss_type="bnpo", beta=0.0)
        out["grpo_dr_grpo_sequence"] = grpo_case(6, loss_type="dr_grpo", importance_sampling_level="sequence")
        return {"cases": out, "memory": memory_case(rank, world)}
    return {"cases": out}


# ---------------------------------------------------------------------------------------------------
# memory


def memory_case(rank, world, seq=1024, pairs=1, vocab=4096):
    """Peak bytes (MemTracker) of one forward + backward of a DPO pair's summed completion log-probs,
    float32, a 1-layer Llama with a 4,096-token vocabulary: the whole rows in one process vs this rank's
    shard under UPipe, each from the full logits (``token_logprobs``) and tiled (``model_token_logprobs``).
    """
    from ds_upipe.tools.memory import measure_peak
    from hf_patches.logprobs import token_logprobs

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, vocab, (2 * pairs, seq), generator=gen)
    mask = torch.zeros_like(ids)
    mask[:, seq // 4 :] = 1
    batch = {"input_ids": ids, "completion_mask": mask}
    model = build_model("llama", torch.float32, seed=0, vocab_size=vocab, num_hidden_layers=1)
    whole = {  # the whole rows (what shard_batch gives a group of one)
        "input_ids": ids,
        "position_ids": torch.arange(seq).expand(2 * pairs, seq),
        "shift_labels": hf_patches.shift_labels(rl_loss.completion_labels(ids, mask)),
    }

    def step(m, shard, tiled, sp):
        def run():
            m.zero_grad(set_to_none=True)
            if tiled:
                logps = model_token_logprobs(m, shard)
            else:
                inputs = {k: shard[k] for k in ("input_ids", "position_ids")}
                logps = token_logprobs(m(**inputs).logits, shard["shift_labels"])
            sums, _ = sequence_logprobs(logps, shard["shift_labels"], group if sp else None)
            sums.sum().backward()

        return run

    peaks = {}
    for tiled in (False, True):
        peaks[f"no_sp_{'tiled' if tiled else 'logits'}"] = measure_peak(
            step(model, whole, tiled, False), [model], torch.device("cpu")
        )
    patched = hf_patches.apply_upipe(copy.deepcopy(model), group)
    shard = rl_loss.shard_completions(batch, group)
    for tiled in (False, True):
        peaks[f"sp_{'tiled' if tiled else 'logits'}"] = measure_peak(
            step(patched, shard, tiled, True), [patched], torch.device("cpu")
        )
    peaks["logits_bytes_whole"] = 2 * pairs * seq * vocab * 4
    return peaks
