"""``UPipeOptions``: every setting of a UPipe run, one frozen object, one name a setting.

It carries the ``"upipe"`` block of a ds_config (``UPipeConfig.options``, the one translation; the keys'
documentation is docs/config.md) and ``hf_patches.apply_upipe``'s keywords from the config to the stage
loop: ``apply_upipe``, the runtime (``UPipeRuntime.build``), the fake runs of "auto" and the planner, and
the bench take it.  Each rule on a setting alone is checked here, once; rules that need the model (U
against its heads) are checked where the heads are known (``ds_upipe.schedule``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

#: the local attention kernels by config name (``kernel_choice.KERNELS`` builds them)
KERNEL_NAMES = ("sdpa", "math", "flash_attn", "fa3")


@dataclass(frozen=True, kw_only=True)
class UPipeOptions:
    """The settings of a UPipe run (module docstring).  Defaults: least memory at about Ulysses' speed."""

    #: U: query heads per stage across the Ulysses group (None: U = C, the least memory)
    head_chunk_size: int | None = None
    #: U of the model's other sequence mixers (gated delta net, Mamba-2: ``hf_patches.mixers``), in their
    #: heads (None: C)
    mixer_head_chunk_size: int | None = None
    #: the local attention kernel ('sdpa', 'math', 'flash_attn', 'fa3')
    kernel: str = "sdpa"
    #: project q/k/v per stage from the layer input (HF models whose attention the family registry
    #: knows; others fall back to the model's own projections, with one warning)
    fused_projections: bool = True
    #: issue the next stage's all-to-alls while the current stage computes (two stages' buffers alive)
    overlap_comm: bool = False
    #: sum bf16/fp16 gradients over the stages in the input dtype instead of float32 (ds_config:
    #: ``accumulate_dtype: "input"``)
    accumulate_in_input_dtype: bool = False
    #: fused mode keeps no attention output: backward recomputes each stage's attention forward
    recompute_attention_output: bool = False
    #: KV-shared layers (Gemma 3n, Gemma 4) attend with their producing layer's keys and values as it exchanged
    #: them, kept from its forward to its backward (``ds_upipe.exchanged_kv``: one exchange per producer, none per
    #: sharing layer), instead of exchanging them again in every sharing layer (less memory, more all-to-alls)
    share_exchanged_kv: bool = True

    def __post_init__(self) -> None:
        for name in ("head_chunk_size", "mixer_head_chunk_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
        if self.kernel not in KERNEL_NAMES:
            raise ValueError(f"unknown attention kernel {self.kernel!r}; choose one of {sorted(KERNEL_NAMES)}")
        if self.recompute_attention_output and not self.fused_projections:
            raise ValueError(
                "recompute_attention_output=True needs fused_projections=True: unfused, o_proj (the model's own "
                "nn.Linear) keeps the attention output for its weight gradient anyway; set fused_projections=True "
                "or recompute_attention_output=False"
            )

    @classmethod
    def of(cls, options: UPipeOptions | None = None, **settings: Any) -> UPipeOptions:
        """``options`` (default: all defaults) with the keyword ``settings`` replaced: the keywords of
        ``apply_upipe`` and the tools' spec objects, one name each (an unknown name is a TypeError)."""
        return replace(options or cls(), **settings)

    def as_run(self, fused_projections: bool) -> UPipeOptions:
        """These options as a model runs them whose fused projections run or not (a model whose attention
        fused mode cannot reproduce falls back): ``recompute_attention_output`` acts only fused."""
        return replace(
            self,
            fused_projections=fused_projections,
            recompute_attention_output=self.recompute_attention_output and fused_projections,
        )

    @property
    def label(self) -> str:
        """The non-default switches, as the planner and the bench name a UPipe variant."""
        return (
            ("" if self.fused_projections else "-unfused")
            + ("+overlap" if self.overlap_comm else "")
            + ("+input-acc" if self.accumulate_in_input_dtype else "")
            + ("+recompute" if self.recompute_attention_output else "")
        )
