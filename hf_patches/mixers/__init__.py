"""Sequence mixers that are not softmax attention (linear attention, state-space, short convolutions),
run under UPipe sequence parallelism.  One module a kind, one entry a kind in ``MIXER_KINDS``.

A kind's module (``hf_patches.mixers.<module>``) provides:

- ``check(layer: int, module: nn.Module, group_size: int, head_chunk_size: int | None) -> None``: raise a
  ValueError naming the layer (``apply_upipe: decoder layer {layer} ({class}): ...``) and the rule for what
  it cannot run, before any collective (same answer on every rank: reads the module and the sizes only);
- ``head_count(module: nn.Module) -> int | None``: the heads its U counts (None: a kind without heads, which
  takes no U);
- ``zero3_params(module: nn.Module) -> list[nn.Parameter]``: the parameters its sharded forward reads
  outside their own submodule's forward (ZeRO-3 must gather them with the mixer module);
- ``sharded_forward(module, hidden_states, *, group, head_chunk_size, documents) -> Tensor``: the
  module's output for this rank's contiguous sequence shard ``hidden_states`` [B, S/C, D], exactly as the
  unpatched module computes it on the whole sequence; ``documents`` (``ds_upipe.packing.DocumentBoundaries``
  of the global sequence, or None) restart the mixer's state at each document start.  ``head_chunk_size``
  is U, the mixer's heads per stage across the group (None: C): the heads run in stages of U/C a rank,
  so a stage's intermediates scale with U.

The exchanges they share are in ``exchange``.
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from ..state import DOCUMENTS_KWARG
from .common import valid_head_chunk_sizes

if TYPE_CHECKING:
    from ..state import UPipeState


@dataclass(frozen=True)
class MixerKind:
    name: str
    #: the transformers module classes of this kind
    classes: tuple[str, ...]
    #: ``config.layer_types`` / ``config.layers_block_type`` names of the layers holding it
    layer_types: tuple[str, ...]
    #: hf_patches.mixers.<module>: check, zero3_params, sharded_forward
    module: str

    def implementation(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.module}")


MIXER_KINDS: dict[str, MixerKind] = {
    kind.name: kind
    for kind in (
        # gated delta net (linear attention): value heads grouped on key heads like GQA
        MixerKind(
            "gated_delta",
            classes=(
                "Qwen3_5GatedDeltaNet",
                "Qwen3_5MoeGatedDeltaNet",
                "Qwen3NextGatedDeltaNet",
                "OlmoHybridGatedDeltaNet",
            ),
            layer_types=("linear_attention",),
            module="gated_delta",
        ),
        # Mamba-2: SSM heads grouped on B/C groups; transformers 5 names Mamba layers "linear_attention"
        # (legacy configs' "mamba" is remapped on load)
        MixerKind(
            "mamba2",
            classes=("NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer"),
            layer_types=("linear_attention", "mamba"),
            module="mamba2",
        ),
        # LFM2's gated short convolution: no heads, a halo of conv_L_cache - 1 tokens from the previous rank
        MixerKind(
            "short_conv", classes=("Lfm2ShortConv", "Lfm2MoeShortConv"), layer_types=("conv",), module="short_conv"
        ),
    )
}


def mixer_kind_of(module_class: str) -> MixerKind | None:
    """The kind of a mixer module class (None: not a mixer ds_upipe runs)."""
    for kind in MIXER_KINDS.values():
        if module_class in kind.classes:
            return kind
    return None


#: every layer type a registered kind runs
MIXER_LAYER_TYPES: tuple[str, ...] = tuple(dict.fromkeys(t for kind in MIXER_KINDS.values() for t in kind.layer_types))


def check_mixers(
    mixers: list[tuple[int, nn.Module]], group_size: int, head_chunk_size: int | None, ring: bool = False
) -> None:
    """Every mixer's refusals, before anything is patched or exchanged: with a ring (UPipe x Ring shards softmax
    attention only: a mixer's heads would need the whole sequence of the ring's other ranks too), then its
    kind's ``check``."""
    if ring and mixers:
        layer, module = mixers[0]
        raise ValueError(
            f"apply_upipe: decoder layer {layer} ({type(module).__name__}) is a sequence mixer: UPipe x Ring shards "
            "attention only; pass ring_group=None for models with such layers"
        )
    for layer, module in mixers:
        kind_module(module).check(layer, module, group_size, head_chunk_size)


def mixer_head_chunk_sizes(mixers: list[tuple[int, nn.Module]], group_size: int) -> list[int]:
    """The U every mixer of the model runs with over ``group_size`` ranks (``common.valid_head_chunk_sizes`` of
    each kind's ``head_count``; kinds without heads take none): what ``mixer_head_chunk_size: "auto"`` picks from."""
    counts = {kind_module(m).head_count(m) for _, m in mixers} - {None}
    valid = [set(valid_head_chunk_sizes(n, group_size)) for n in counts]
    return sorted(set.intersection(*valid)) if valid else []


def kind_module(module: nn.Module) -> ModuleType:
    """The implementation of a registered mixer module's kind."""
    kind = mixer_kind_of(type(module).__name__)
    assert kind is not None, type(module).__name__  # find_decoder lists registered kinds only
    return kind.implementation()


def patch_mixers(mixers: list[tuple[int, nn.Module]], state: UPipeState) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Run each mixer head-sharded in stages under ``state`` (its group, ``options.mixer_head_chunk_size``);
    returns, per module, the parameters ZeRO-3 must gather with it (``zero3_params``)."""
    external = []
    for _, module in mixers:
        module._upipe_state = state
        module._upipe_mixer = kind_module(module)
        module.forward = types.MethodType(_sharded_mixer_forward, module)
        external.append((module, module._upipe_mixer.zero3_params(module)))
    return external


def _sharded_mixer_forward(
    self: nn.Module,
    hidden_states: Tensor,
    cache: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """A patched mixer's forward: this rank's shard in, this rank's shard out (``sharded_forward``); the
    forward's packed-document boundaries arrive as the attention modules' do (``DOCUMENTS_KWARG``)."""
    if cache is not None:
        raise ValueError(f"{type(self).__name__}: a cache (generation) is not supported under UPipe")
    if attention_mask is not None and not bool(attention_mask.all()):
        # the model-level input check turns right padding into no mask (causal); anything else is refused there
        raise ValueError(f"{type(self).__name__}: a padding mask reached a sharded mixer (UPipe takes right padding)")
    state = self._upipe_state
    return self._upipe_mixer.sharded_forward(
        self,
        hidden_states,
        group=state.group,
        head_chunk_size=state.options.mixer_head_chunk_size,
        documents=kwargs.get(DOCUMENTS_KWARG),
    )
