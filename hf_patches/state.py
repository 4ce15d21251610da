"""The UPipe runtime of one patched model, shared by its attention modules, and the per-forward kwarg."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ds_upipe.packing import DocumentBoundaries
from ds_upipe.pipeline import PipelineContext
from ds_upipe.runtime import UPipeRuntime
from ds_upipe.schedule import StagePlan

#: The keyword argument that carries one forward's packed-sequence boundaries (``DocumentBoundaries``,
#: or None) from the model-level input check to every attention module of that forward.  It travels
#: with the forward as transformers threads its own ``cu_seq_lens_*`` kwargs (base model -> decoder
#: layers -> attention), so a checkpointed layer's replay in backward gets the boundaries of the
#: forward it replays, whatever forwards ran in between (never read back from shared state).
DOCUMENTS_KWARG = "upipe_documents"
#: The keyword argument that carries one forward's bidirectional spans (``ds_upipe.spans.BidirectionalSpans``:
#: Gemma 3's images, computed by ``hf_patches.vlm`` on the whole sample), travelling as ``DOCUMENTS_KWARG`` does
SPANS_KWARG = "upipe_image_spans"


#: The keyword argument that carries one forward's ``ExchangedKeyValues`` (or None: every layer exchanges its
#: own keys and values) from the model-level input check to every attention module of that forward, as
#: ``DOCUMENTS_KWARG`` travels (a checkpointed layer's replay gets the object of the forward it replays).
EXCHANGED_KV_KWARG = "upipe_exchanged_kv"


@dataclass(frozen=True)
class _Exchanged:
    """One producer's exchange: the local key and value it was given, the plan, and what the exchange gave."""

    key: torch.Tensor
    value: torch.Tensor
    plan: StagePlan
    exchanged: tuple[torch.Tensor, torch.Tensor]


@dataclass
class ExchangedKeyValues:
    """One forward's keys and values as its KV-producing attention layers exchanged them
    (``ds_upipe.exchanged_kv``; transformers declares a producer ``store_full_length_kv``), for its KV-shared
    layers, which get the producer's very key and value tensors (``shared_kv_states``).  Made per forward by the
    model-level input check (``EXCHANGED_KV_KWARG``) and dropped with it: nothing outlives the forward except what
    the autograd nodes saved (and, under checkpointing, what the replays need: ``keep``)."""

    by_producer: dict[int, _Exchanged] = field(default_factory=dict)

    def find(self, key: torch.Tensor, value: torch.Tensor, plan: StagePlan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The exchanged K/V of the producer that was given this very ``key`` and ``value`` under ``plan``."""
        for held in self.by_producer.values():
            if held.key is key and held.value is value and held.plan == plan:
                return held.exchanged
        return None

    def keep(
        self,
        producer: nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: StagePlan,
        exchanged: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Keep a producer's exchange for its sharing layers.  A producer's second call in one forward is its
        checkpointed replay in backward, after its sharing layers' backward: the forward's exchange is dropped
        (freed now, not at the end of the backward) and the replay's is kept by its own autograd nodes only."""
        if self.by_producer.pop(id(producer), None) is None:
            self.by_producer[id(producer)] = _Exchanged(key, value, plan, exchanged)


@dataclass(kw_only=True)
class UPipeState(UPipeRuntime):
    """The UPipe runtime of one patched model (read it with ``hf_patches.upipe_state``): the core's
    ``ds_upipe.runtime.UPipeRuntime``, built by ``UPipeState.build`` the same way on every route
    (``apply_upipe``, the Trainer / accelerate registration's core attention function), with what the
    HF model adds.  ``overlap_comm``, ``accumulate_in_input_dtype`` and ``recompute_attention_output``
    are settable after apply_upipe."""

    #: why fused projections are off although requested (None when fused or not requested)
    fallback_reason: str | None = None
    architecture: str = ""
    #: set once fused mode has logged that it runs unfused under torch.autocast
    autocast_warned: bool = False
    #: documents per batch row of the last attention call (None: one per row): a report for examples
    #: and tests only; the computation takes each call's boundaries from its forward (DOCUMENTS_KWARG)
    last_documents_per_row: tuple[int, ...] | None = None
    #: the first decoder layer that does not pass its forward's kwargs on to its attention (None: all do;
    #: ``architectures.DecoderModel.kwargs_dropped_by``): packed documents are refused for such a model
    kwargs_dropped_by: str | None = None

    def context(
        self,
        device: torch.device,
        documents: DocumentBoundaries | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> PipelineContext:
        """``UPipeRuntime.context`` of one attention call; ``documents`` are that call's packed-sequence
        boundaries (``DOCUMENTS_KWARG``)."""
        self.last_documents_per_row = None if documents is None else tuple(len(r) - 1 for r in documents.rows)
        return super().context(device, documents, window, sinks, **kwargs)
