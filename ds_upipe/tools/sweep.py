"""``ds-upipe sweep``: every causal decoder family of transformers, patched, against itself unpatched.

For each model type of transformers' causal-LM auto mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``; a
composite vision-language entry stands for its text model), a tiny float64 model is built from a config
(``COMMON`` and the family's ``OVERRIDES``), patched by ``apply_upipe`` and run on C = 2 gloo ranks on
sequence shards (global position_ids), and compared with the same model unpatched on the whole sequence in
one process: logits, loss and every parameter gradient (``ds_upipe.tools.parity``), fused where fused
projections apply and unfused.  Every model type gets one row:

- ``exact-fused``: fused and unfused both within the tolerance; ``exact-unfused``: fused projections do not
  apply (the reason is kept) and unfused is within it;
- ``refused``: ``apply_upipe`` refused it with ds_upipe's own message (``OWN_MESSAGES``);
- ``failed``: anything else (an exception from elsewhere, or an error above the tolerance);
- ``not-built``: its tiny config or model cannot be built, or the unpatched model does not run on CPU.

Beside it, the peer baseline: DeepSpeed ALST (DeepSpeed-Ulysses for HF models) as a plain ALST user runs it
(the model in sdpa, ``UlyssesSPAttentionHF.register_with_transformers`` with the model object), on the same
tiny model, the same shards, loss and gradient sum (``parity.sharded_step``) and against the same unpatched
reference: ``exact`` (within the family's tolerance), ``wrong`` (silently: no error, numbers above it; the
largest error kept) or ``crashed`` (the exception's first line).

All families run in one spawn of two ranks; each family gets its own process group with a short timeout,
so that a family failing on one rank only (the other then waits in a collective) costs that timeout and
not the sweep.
"""

from __future__ import annotations

import copy
import datetime
import logging
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ds_upipe
import hf_patches
from hf_patches.architectures import calls_attention_registry

from . import parity
from .models import ARCHS
from .ranks import run_ranks

#: the sweep's sequence-parallel degree
WORLD = 2
#: float64 parity: relative error of logits, loss and every gradient
TOLERANCE = 1e-10
#: seconds a family's collectives may wait for the other rank
FAMILY_TIMEOUT_S = 60

#: every family's tiny config: hidden 64, 2 layers, 8 query heads of 8 over 2 KV heads, vocabulary 101
COMMON: dict[str, Any] = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.1,
    use_cache=False,
    tie_word_embeddings=False,
)

#: set wherever the family's config has the key: a sparse MoE block small enough for the sweep (eager experts:
#: grouped_mm has no float64), no router loss (its sum over a shard differs), small per-layer input embeddings
SMALL: dict[str, Any] = dict(
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    output_router_logits=False,
    vocab_size_per_layer_input=101,
    hidden_size_per_layer_input=8,
    pad_token_id=0,
    sliding_window=4,  # below the sweep's 12 tokens, so that a sliding-window layer differs from full attention
)

_KV_SHARED: dict[str, Any] = dict(
    num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2
)

#: multi-head latent attention's tiny shapes: q/k heads of 8 + 4 (the rope part; its configs' ``head_dim``), values
#: of 8 (narrower than q/k, as DeepSeek's 128 against 192), every query head its own key and value head (as the
#: up-projection gives them)
MLA: dict[str, Any] = dict(
    num_key_value_heads=8, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=4,
    v_head_dim=8, n_group=1, topk_group=1,
)  # fmt: skip

#: model type -> what its tiny config changes over ``COMMON`` and ``SMALL`` (the one table of per-family
#: overrides); the hybrids of ``models.ARCHS`` take their layer patterns and mixer heads from there
OVERRIDES: dict[str, dict[str, Any]] = {
    **{
        t: dict(MLA) for t in ("axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu")
    },
    **{t: dict(ARCHS[t][2]) for t in ("qwen3_5", "qwen3_next", "olmo_hybrid", "nemotron_h", "lfm2")},
    **{t: dict(ARCHS["qwen3_5"][2]) for t in ("qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")},
    "lfm2_moe": dict(ARCHS["lfm2"][2]),
    # Mamba-2 hybrids: an attention layer beside the Mamba layer, small SSM heads (the default scan is slow on CPU)
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=4, mamba_chunk_size=4),
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        num_local_experts=0,
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=4,
        mamba_d_head=16,
        mamba_chunk_size=4,
    ),
    "dots3_note": dict(num_key_value_heads=8),  # its validator: no GQA
    "dots3_note_text": dict(num_key_value_heads=8),
    # Gemma 3n: 4 layers, the last two KV-shared (they take layers 0 and 1's keys and values: shared_kv_states)
    **{t: dict(_KV_SHARED, activation_sparsity_pattern=[0.0] * 4) for t in ("gemma3n", "gemma3n_text")},
    # Gemma 4: the same, and full layers of their own head dim (global_head_dim: per-layer settings)
    **{t: dict(_KV_SHARED, global_head_dim=16) for t in ("gemma4_text", "gemma4_unified", "gemma4_unified_text")},
    # the composite entry with the 26B / 31B checkpoints' full layers of their own key/value heads (1, keys as
    # values): each layer runs the stage plan of its own heads
    "gemma4": dict(_KV_SHARED, global_head_dim=16, attention_k_eq_v=True, num_global_key_value_heads=1),
    "codegen": dict(rotary_dim=8),  # at most head_dim
    "gptj": dict(rotary_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], num_layers=2),
    "kolibri1_1": dict(head_dim=16, index_num_heads=2),  # NVFP4 rounding needs head_dim a multiple of 16
    "mamba2": dict(num_heads=16),  # num_heads * head_dim = hidden_size * expand
    "plbart": dict(encoder_attention_heads=8, decoder_attention_heads=8),
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=[32, 32], axial_pos_shape=[16, 16]),
    "whisper": dict(encoder_attention_heads=8, decoder_attention_heads=8),
    "xlnet": dict(d_head=8),
    "zamba": dict(num_hidden_layers=3),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    "zaya": dict(num_experts_per_tok=1),  # its validator: top-1 routing only
}

#: parameters above which a tiny config is taken as not tiny (a size key the overrides miss)
MAX_PARAMETERS = 10_000_000

_ROUTER = "the router's logits in float32 (its weight's gradient, a float32 sum over a shard's tokens)"
_SINK = "the reference's sink scale sigmoid(lse - sink) in float32 (its eager attention function)"
#: model type -> (tolerance, why): families that compute parts in float32 explicitly (a dtype argument or a float32
#: parameter, which ``parity.float64_internals`` does not keep in float64)
TOLERANCES: dict[str, tuple[float, str]] = {
    **{t: (1e-6, _ROUTER) for t in ("dots1", "exaone_moe", "glm4_moe", "kolibri1", "minicpm5_moe", "solar_open")},
    **{t: (1e-6, _ROUTER) for t in ("param2moe", "sarvam_moe")},
    "granite_swa": (1e-6, _SINK),
    "granitemoe_swa": (1e-6, _SINK),
    "diffllama": (1e-6, "its lambda, a float32 sum of the lambda parameters' products (torch.sum(dtype=float32))"),
}

#: the prefixes of ds_upipe's own refusals (apply_upipe, the ds_config reader, hf_patches' messages)
OWN_MESSAGES: tuple[str, ...] = ("apply_upipe", "invalid ds_config", "hf_patches")

STATUSES = ("exact-fused", "exact-unfused", "refused", "failed", "not-built")
#: DeepSpeed ALST's column ("" where it was not run: the family not built, or not among ``alst_types``)
ALST_STATUSES = ("exact", "wrong", "crashed")


@dataclass
class Row:
    """One model type's result."""

    model_type: str
    status: str
    detail: str = ""
    errors: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    alst: str = ""
    alst_detail: str = ""
    alst_errors: dict[str, float] = field(default_factory=dict)


class NotBuilt(Exception):
    """The family's tiny model cannot be built, or its unpatched model does not run."""


def causal_lm_types() -> list[str]:
    """Every model type of transformers' causal-LM auto mapping, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> Any:
    """The family's tiny config (a composite config: its text decoder's): ``COMMON`` and ``SMALL`` where the
    config has the key (or maps it: GPT-2's ``n_embd``), then the family's ``OVERRIDES``."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    text = config.get_text_config(decoder=True)  # a composite (vision-language) config: UPipe runs its text model
    known = {*text.to_dict(), *getattr(type(text), "attribute_map", {})}
    fields = {k: v for k, v in {**COMMON, **SMALL}.items() if k in known}
    fields["experts_implementation"] = "eager"  # every config's: grouped_mm has no float64
    fields.update(OVERRIDES.get(model_type, {}))
    return type(text)(**fields) if text is not config else transformers.AutoConfig.for_model(model_type, **fields)


def causal_lm_class(model_type: str, config: Any) -> type:
    """The causal LM the sweep builds: the mapping's class of the text config's model type (of a composite
    entry: its text model's), else the mapping's class of ``model_type``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names

    return getattr(transformers, names.get(config.model_type, names[model_type]))


def build_model(model_type: str, seed: int = 0, refuse_early: bool = True) -> torch.nn.Module:
    """The family's tiny causal LM in float64 (random weights from ``seed``; sinks random so that they matter).
    ``refuse_early``: ``apply_upipe``'s structural refusals (``find_decoder``) are raised on a parameter-free copy
    first, so a refused family costs no real model (off where ALST's column needs the model anyway)."""
    from hf_patches.architectures import find_decoder

    try:
        config = tiny_config(model_type)
        cls = causal_lm_class(model_type, config)
        with torch.device("meta"):  # sized before any memory is spent on it
            skeleton = cls(config)
    except Exception as err:  # noqa: BLE001 - any failure of transformers' classes is the row's reason
        raise NotBuilt(f"{type(err).__name__}: {_first_line(err)}") from err
    if refuse_early:
        find_decoder(skeleton)
    size = sum(p.numel() for p in skeleton.parameters())
    if size > MAX_PARAMETERS:
        raise NotBuilt(f"{size} parameters, not tiny (a size key of its config is not overridden)")
    torch.manual_seed(seed)
    try:
        model = cls(config).to(torch.float64)
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"{type(err).__name__}: {_first_line(err)}") from err
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_()
    # eval: dropout (CTRL's residual dropout) and router noise (PhiMoE's jitter) draw other random numbers on
    # a shard than on the whole sequence; gradients flow as in training
    return model.eval()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else ""


def is_own_refusal(err: BaseException) -> bool:
    """Whether ``err`` is one of ds_upipe's refusals: a ValueError whose message starts with one of
    ``OWN_MESSAGES``, or raised by ds_upipe's own code (a forward-time check of hf_patches, naming the module)."""
    if not isinstance(err, ValueError):
        return False
    frames = traceback.extract_tb(err.__traceback__)
    raised_by = Path(frames[-1].filename).resolve() if frames else None
    own = raised_by is not None and any(raised_by.is_relative_to(root) for root in _OWN_ROOTS)
    return own or str(err).startswith(OWN_MESSAGES)


#: the folders of ds_upipe's own code (the ds_upipe and hf_patches packages)
_OWN_ROOTS = tuple(Path(m.__file__).resolve().parent for m in (ds_upipe, hf_patches))


def _patched_errors(model, ref, batch, group, fused: bool) -> tuple[dict[str, float], str | None]:
    """(errors, why fused projections do not apply) of ``model`` patched with ``fused``."""
    hf_patches.apply_upipe(model, group, fused_projections=fused)
    state = hf_patches.upipe_state(model)
    errors = parity.compare(ref, parity.sharded_step(model, batch, group), batch["input_ids"].shape[1])
    if fused and not any(calls_attention_registry(m) for m in model.modules()):
        return errors, "no softmax attention layer (fused projections have nothing to fuse)"
    return errors, state.fallback_reason if fused and not state.fused_projections else None


def alst_step(model, batch, group) -> tuple:
    """DeepSpeed ALST's sharded step of ``model`` (changed: its attention implementation, sdpa), as a plain ALST
    user runs it: ``register_with_transformers`` with the model object (it replaces sdpa in transformers'
    attention registry and builds DeepSpeed's sequence-parallel groups of ``WORLD`` ranks); both are undone after."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    saved = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    try:
        if model.config._attn_implementation != "sdpa":
            model.set_attn_implementation("sdpa")  # ALST runs flash, flex or sdpa; CPU: sdpa
        UlyssesSPAttentionHF.register_with_transformers(
            model, "sdpa", WORLD, micro_batch_size=batch["input_ids"].shape[0], seq_length_is_variable=True
        )
        return parity.sharded_step(model, batch, group)
    finally:
        # both ranks done with DeepSpeed's groups before either tears them down (gloo: a peer still connecting
        # to a group the other has destroyed fails in connectFullMesh)
        dist.barrier(group=group)
        ALL_ATTENTION_FUNCTIONS._local_mapping.clear()
        ALL_ATTENTION_FUNCTIONS._local_mapping.update(saved)
        for sp_group in {parallel_state_sp._SEQUENCE_PARALLEL_GROUP, parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP}:
            if sp_group is not None:
                dist.destroy_process_group(sp_group)
        parallel_state_sp._release_sequence_parallel_groups()


def alst_column(model, ref, batch, group, tolerance: float) -> tuple[str, str, dict[str, float]]:
    """ALST's (status, detail, errors) on a copy of ``model`` against ``ref`` (``ALST_STATUSES``)."""
    try:
        with parity.float64_internals():  # as for UPipe's rows
            errors = parity.compare(ref, alst_step(copy.deepcopy(model), batch, group), batch["input_ids"].shape[1])
    except Exception as err:  # noqa: BLE001 - every exception is ALST's crash
        return "crashed", f"{type(err).__name__}: {_first_line(err)} ({_where(err)})", {}
    worst = max(errors.values())
    if worst > tolerance:
        return "wrong", f"error {worst:.1e}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), errors
    return "exact", "", errors


def _model_and_reference(model_type: str, refuse_early: bool = True) -> tuple:
    """(model, batch, the unpatched reference step); ``NotBuilt`` where the model does not build or run."""
    model = build_model(model_type, refuse_early=refuse_early)
    batch = parity.make_batch(0, 2, 6 * WORLD)
    try:
        with parity.float64_internals():
            return model, batch, parity.reference_step(model, batch)
    except Exception as err:  # noqa: BLE001
        raise NotBuilt(f"unpatched model on CPU: {type(err).__name__}: {_first_line(err)}") from err


def sweep_family(model_type: str, group, alst: bool = True) -> Row:
    """One model type's row (run by every rank of ``group``); ``alst``: with DeepSpeed ALST's column."""
    start = time.perf_counter()
    tolerance = TOLERANCES.get(model_type, (TOLERANCE, ""))[0]
    try:
        model, batch, ref = _model_and_reference(model_type)
    except NotBuilt as err:
        return Row(model_type, "not-built", str(err), seconds=time.perf_counter() - start)
    except Exception as err:  # noqa: BLE001 - a structural refusal (find_decoder on the parameter-free copy)
        row = _refused_or_failed(model_type, err, start)
        if alst:  # ALST's column needs the model all the same
            try:
                model, batch, ref = _model_and_reference(model_type, refuse_early=False)
                row.alst, row.alst_detail, row.alst_errors = alst_column(model, ref, batch, group, tolerance)
            except NotBuilt:
                pass
        row.seconds = time.perf_counter() - start
        return row
    columns = {}
    if alst:
        columns = dict(zip(("alst", "alst_detail", "alst_errors"), alst_column(model, ref, batch, group, tolerance)))
    try:
        with parity.float64_internals():  # transformers' float32 casts: split sums would differ by ~1e-7
            errors, fallback = _patched_errors(copy.deepcopy(model), ref, batch, group, fused=True)
            results = {"fused" if fallback is None else "unfused": errors}
            if fallback is None:
                results["unfused"] = _patched_errors(copy.deepcopy(model), ref, batch, group, fused=False)[0]
    except Exception as err:  # noqa: BLE001 - every family gets a row
        return _refused_or_failed(model_type, err, start, columns)
    flat = {f"{mode}.{k}": v for mode, errs in results.items() for k, v in errs.items()}
    worst = max(flat.values())
    if worst > tolerance:
        detail = f"error {worst:.2e} above the tolerance {tolerance:.0e}: " + ", ".join(
            f"{k} {v:.1e}" for k, v in flat.items() if v > tolerance
        )
        return Row(model_type, "failed", detail, flat, time.perf_counter() - start, **columns)
    status = "exact-fused" if "fused" in results else "exact-unfused"
    notes = [f"unfused: {_short_fallback(fallback)}"] if fallback is not None else []
    if model_type in TOLERANCES:
        notes.append(f"within {tolerance:.0e}: {TOLERANCES[model_type][1]}")
    return Row(model_type, status, "; ".join(notes), flat, time.perf_counter() - start, **columns)


def _refused_or_failed(model_type: str, err: Exception, start: float, columns: dict[str, Any] | None = None) -> Row:
    status = "refused" if is_own_refusal(err) else "failed"
    detail = str(err) if status == "refused" else f"{type(err).__name__}: {_first_line(err)} ({_where(err)})"
    return Row(model_type, status, detail, seconds=time.perf_counter() - start, **(columns or {}))


def _short_fallback(reason: str) -> str:
    """A fused-mode fallback reason in short: every attention class without a family-registry entry gets the
    same long one (the registry's list of classes)."""
    name, unknown, _ = reason.partition(" is not one of ")
    return f"{name} has no family-registry entry" if unknown else reason


def _where(err: BaseException) -> str:
    """The innermost frame of the traceback (file:line), for a failed row."""
    frames = traceback.extract_tb(err.__traceback__)
    return f"{frames[-1].filename.rsplit('/site-packages/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"


def _quiet() -> None:
    """The sweep's own rows say what each family did; the per-model warnings would bury them."""
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_patches").setLevel(logging.ERROR)


def _merge(rows: list[Row]) -> Row:
    """The ranks' rows of one family as one: the first rank's unless another's is worse (ALST's column alike)."""
    order = {s: i for i, s in enumerate(("failed", "refused", "not-built", "exact-unfused", "exact-fused"))}
    row = copy.copy(min(rows, key=lambda r: order[r.status]))
    alst_order = {s: i for i, s in enumerate(("crashed", "wrong", "exact", ""))}
    worst = min(rows, key=lambda r: alst_order[r.alst])
    row.alst, row.alst_detail, row.alst_errors = worst.alst, worst.alst_detail, worst.alst_errors
    return row


def sweep_ranks(
    rank: int, world: int, model_types: list[str], alst_types: list[str], verbose: bool
) -> list[dict[str, Any]]:
    """Inside a rank: every family's row, each on its own process group (``verbose``: rank 0 prints each row);
    the families of ``alst_types`` with ALST's column."""
    _quiet()
    rows = []
    for i, model_type in enumerate(model_types):
        group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=FAMILY_TIMEOUT_S))
        row = sweep_family(model_type, group, alst=model_type in alst_types)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, row)  # the default group: both ranks meet here whatever happened
        rows.append(asdict(_merge(gathered)))
        if verbose and rank == 0:
            row = rows[-1]
            alst = f", ALST {row['alst']}" if row["alst"] else ""
            print(
                f"[{i + 1}/{len(model_types)}] {model_type}: {row['status']}{alst} ({row['seconds']:.1f} s)", flush=True
            )
        dist.destroy_process_group(group)
    return rows


def run_sweep(
    model_types: list[str] | None = None,
    timeout: float = 3600,
    verbose: bool = False,
    alst_types: list[str] | None = None,
) -> list[Row]:
    """Every family of ``model_types`` (default: the whole causal-LM mapping) on ``WORLD`` ranks, one spawn (with
    DeepSpeed's communication up: ALST builds its groups through it); ALST's column for ``alst_types`` (default:
    all of them)."""
    types = model_types or causal_lm_types()
    alst = types if alst_types is None else alst_types
    unknown = sorted((set(types) | set(alst)) - set(causal_lm_types()))
    if unknown:
        raise ValueError(f"model types {unknown} are not in transformers' causal-LM auto mapping")
    results = run_ranks(sweep_ranks, WORLD, types, list(alst), verbose, timeout=timeout, use_deepspeed=True)
    return [Row(**r) for r in results[0]]


def counts(rows: list[Row]) -> dict[str, int]:
    return {s: sum(r.status == s for r in rows) for s in STATUSES}


def alst_counts(rows: list[Row]) -> dict[str, int]:
    return {s: sum(r.alst == s for r in rows) for s in ALST_STATUSES}


def format_table(rows: list[Row]) -> str:
    """The markdown table of ``rows`` (docs/families.md's body): ours, then DeepSpeed ALST's."""
    lines = ["| model type | UPipe | why / details | DeepSpeed ALST | ALST details |", "|---|---|---|---|---|"]
    for r in rows:
        detail, alst_detail = (d.replace("|", "\\|").replace("\n", " ") for d in (r.detail, r.alst_detail))
        lines.append(f"| `{r.model_type}` | {r.status} | {detail} | {r.alst or '-'} | {alst_detail} |")
    return "\n".join(lines)


def markdown_page(rows: list[Row], command: str, seconds: float) -> str:
    """docs/families.md: how it was made, the counts, the table."""
    tally = ", ".join(f"{n} {status}" for status, n in counts(rows).items())
    alst_tally = ", ".join(f"{n} {status}" for status, n in alst_counts(rows).items())
    return (
        "# Every causal decoder family of transformers under UPipe, and under DeepSpeed ALST\n\n"
        f"Written by `{command}` (ds_upipe/tools/sweep.py; {seconds:.0f} s on 2 CPU ranks): each model type of "
        "transformers' causal-LM auto mapping, a tiny float64 model patched by `apply_upipe` on 2 ranks against "
        f"the same model unpatched on the whole sequence (logits, loss, every gradient; relative {TOLERANCE:.0e}), "
        "fused where fused projections apply and unfused; 2 rows of 12 tokens, sliding windows of 4 where the config "
        "has one.  `exact-fused`: both modes exact; `exact-unfused`: "
        "fused projections do not apply (the reason shown), unfused exact; `refused`: ds_upipe's own message; "
        "`not-built`: the tiny config or the unpatched model does not build or run on CPU.\n\n"
        "The peer baseline, DeepSpeed ALST (DeepSpeed-Ulysses for HF models, "
        "`UlyssesSPAttentionHF.register_with_transformers` with the model object, sdpa), runs the same model on "
        "the same shards with the same loss and gradient sum, against the same reference: `exact` (within the "
        "family's tolerance), `wrong` (no error raised, the numbers off: the largest relative errors shown) or "
        "`crashed` (the exception's first line and where); `-`: the model does not build or run unpatched.\n\n"
        f"UPipe: {tally}.\n\nDeepSpeed ALST: {alst_tally}.\n\n{format_table(rows)}\n"
    )
