"""One exchange over all ranks before the first collective that depends on the configuration.

Every rank reads its own ds_config.  Where the ranks' settings differ, or one rank's config is
invalid and another's is not, the ranks would go separate ways: a rank with another
``sequence_parallel_size`` creates other groups (all ranks hang in ``new_group``), a rank with
``upipe.enabled`` false waits in a ZeRO-3 fetch while the UPipe ranks wait in the input check, a
rank with the tiled loss or offloaded checkpoints runs other collectives (gloo aborts with
"collective mismatch"), and a rank that raised leaves the others waiting.  So right after the
process group exists, each rank hands every other rank its validation error (or None) and the
settings that must agree, in one ``all_gather_object``, and every rank raises the same ValueError:
the error of the lowest rank that had one, or the settings that differ with their per-rank values.
(DeepSpeed has no such exchange: its engine assumes identical configs.)
"""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from ds_upipe.validation import mismatched_settings

#: the ds_config sections (besides sequence_parallel_size and the "upipe" block) whose values decide
#: which collectives a rank runs before or inside the first training step
AGREED_SECTIONS = ("activation_checkpointing", "zero_optimization", "bf16", "fp16")


def agreed_settings(ds_config: dict[str, Any], upipe: Any | None) -> dict[str, Any]:
    """The flat ``{"key.path": value}`` a rank's config must share with every other rank: the
    sequence-parallel size, every key of the validated ``upipe`` block (None: it did not validate),
    and the sections of ``AGREED_SECTIONS`` as given."""
    flat: dict[str, Any] = {"sequence_parallel_size": ds_config.get("sequence_parallel_size", 1)}
    if upipe is not None:
        flat.update({f"upipe.{key}": value for key, value in upipe.model_dump(mode="json").items()})
    for section in AGREED_SECTIONS:
        for key, value in sorted((ds_config.get(section) or {}).items()):
            flat[f"{section}.{key}"] = value
    # JSON values only: what is compared is what is shown
    return json.loads(json.dumps(flat, default=str))


def check_ranks_agree(error: str | None, settings: dict[str, Any], group: Any = None) -> None:
    """Raise the same ValueError on every rank of ``group`` (default: all) unless no rank had a
    validation ``error`` and all ranks' ``settings`` are equal.  A collective: every rank calls it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise ValueError(error)
        return
    rows: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(rows, (error, settings), group=group)
    errors = [(rank, err) for rank, (err, _) in enumerate(rows) if err is not None]
    if errors:
        rank, first = errors[0]
        if len(errors) == len(rows) and all(err == first for _, err in errors):
            raise ValueError(first)  # the same config error everywhere: its own words
        others = [r for r, _ in errors[1:]]
        raise ValueError(
            f"{first} (raised on rank {rank}{f' and ranks {others}' if others else ''}; the ranks' ds_configs differ: "
            "every rank must be given the same ds_config)"
        )
    differ = mismatched_settings([s for _, s in rows])
    if differ:
        shown = "; ".join(f"{key} per rank {values}" for key, values in differ.items())
        raise ValueError(
            f"ds_config settings differ across ranks: {shown}. Every rank must be given the same ds_config "
            "(sequence_parallel_size, the upipe block, zero_optimization, activation_checkpointing, bf16/fp16)"
        )
