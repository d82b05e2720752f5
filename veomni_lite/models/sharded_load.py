"""Weights written straight into FSDP2 shards: no device, and no rank but the builder, holds the whole model.

A model built from a config (random init) is built whole on rank 0 only, with the run's seed, and on the meta device
elsewhere. `rank0_weights` keeps rank 0's tensors before its model moves to the meta device too; after `fully_shard`
and `to_empty`, `scatter_from_rank0` broadcasts them one tensor at a time and each rank keeps its own shards
(`set_model_state_dict`, full state from rank 0), so the values are the whole build's, on any layout.

Pretrained weights:

`build_on_meta(directory)` builds the directory's model (behind the trainer's contract, as `load_model` does) on the
meta device, so building allocates nothing. After `fully_shard` and `to_empty`, `load_into_shards(model, directory)`
reads each rank's slices of the weights from the directory's safetensors through DCP's `HuggingFaceStorageReader`
(headers and the byte ranges of this rank's shards; safetensors holds no code) and recomputes the buffers that are
not saved (rotary frequencies) with transformers' own initializer for them.

Names are mapped through transformers' own key conversions for the model class: its renamings (Qwen2-VL directories
keep an older layout) and the fused experts' of a mixture of experts (transformers 5 holds a layer's routed experts as
3-D tensors, e.g. `experts.gate_up_proj` [E, 2I, H], and writes each expert's `experts.<e>.gate_proj.weight` and
`up_proj.weight` [I, H]: each rank reads the experts of its own shard into their slices; Qwen3-VL-MoE's stored
[E, H, 2I] fills a transposed view). `loadable(model, directory)` says whether every weight is found that way; where a
model class's conversions do more (split, interleave, dequantize), it is not, and rank 0 loads the directory whole
and scatters it (`BaseTrainer.pretrained_model`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from veomni_lite.models.lora import is_adapter_key
from veomni_lite.models.pretrained import hf_child, load_config
from veomni_lite.models.registry import family_of


def weight_names(directory: str | Path) -> set[str]:
    """The tensor names of the directory's safetensors (read from the index or the file headers, no tensor data)."""
    from safetensors import safe_open

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names.update(handle.keys())
    return names


def weight_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """The shapes of the directory's safetensors tensors (read from the file headers, no tensor data)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            names = handle.keys()
            shapes |= {name: tuple(handle.get_slice(name).get_shape()) for name in names}
    return shapes


def build_on_meta(directory: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of `directory` (see `pretrained.load_model`) with every parameter and buffer on the meta device, in
    `dtype` (the shards are filled in that dtype, whatever the files store)."""
    config = load_config(directory)
    with torch.device("meta"):
        return family_of(config).build(config, dtype)


@dataclass(frozen=True)
class _Piece:
    """One stored tensor of a fused parameter: expert `expert`'s slice `part` of `parts` along dim 1 (a merged list
    of per-expert tensors, concatenated when `parts` > 1), or with `transposed` dims 1 and 2 swapped (the whole
    parameter, stored [E, in, out])."""

    stored: str
    expert: int | None = None
    part: int = 0
    parts: int = 1
    transposed: bool = False


def _merged_experts(converter: Any) -> tuple[int, bool] | None:
    """(number of source patterns, transposed) of a converter that only merges a list of per-expert tensors (and
    concatenates the lists along dim 1), or only swaps dims 1 and 2: the fused experts' layouts; else None."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, Transpose, WeightConverter

    if not isinstance(converter, WeightConverter):
        return None
    ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    sources = converter.source_patterns
    if ops in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
        return (len(sources), False) if all(pattern.count("*") == 1 for pattern in sources) else None
    transpose = converter.operations[0] if len(converter.operations) == 1 else None
    if isinstance(transpose, Transpose) and {transpose.dim0, transpose.dim1} == {1, 2} and len(sources) == 1:
        return 1, True
    return None


def _checkpoint_names(hf_model: Any, directory: str | Path) -> dict[str, list[_Piece]]:
    """{name in the model: its stored tensors}, through transformers' own key conversions for this model class: its
    renamings (e.g. Qwen2-VL's older layout) and the fused experts' (`_merged_experts`: a [E, 2I, H] `gate_up_proj`
    stored as each expert's `gate_proj` and `up_proj`, or transposed); empty when some conversion does more."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    layouts = [_merged_experts(converter) for converter in converters]
    if any(layout is None for layout in layouts):
        return {}
    meta = hf_model.state_dict()
    prefix = hf_model.base_model_prefix
    shapes = weight_shapes(directory) if any(layout[1] for layout in layouts) else {}
    names: dict[str, list[_Piece]] = {}
    for stored in sorted(weight_names(directory)):
        name, pattern = rename_source_key(stored, renamings, converters, prefix, meta)
        piece = _Piece(stored)
        if pattern is not None:
            converter, (parts, transposed) = next(
                (c, layout) for c, layout in zip(converters, layouts) if pattern in c.source_patterns
            )
            if transposed:  # as transformers' Transpose(check_dims=True): only where the stored shape differs
                same = name in meta and shapes.get(stored) == tuple(meta[name].shape)
                piece = _Piece(stored, transposed=not same)
            else:
                expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), stored)
                if expert is None:
                    return {}
                piece = _Piece(stored, int(expert.group(1)), converter.source_patterns.index(pattern), parts)
        names.setdefault(name, []).append(piece)
    return names


def _local_experts(tensor: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(this rank's rows of a [E, ...] parameter, the global index of its first), or None where it is not split
    along the experts (dim 0) only."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(isinstance(p, Shard) and p.dim != 0 for p in tensor.placements):
        return None
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), offset[0]


def _views(tensor: torch.Tensor, pieces: list[_Piece]) -> dict[str, torch.Tensor] | None:
    """{stored name: the view of `tensor` (this rank's part of it) that stored tensor fills}; None where the pieces
    do not cover the parameter as one plain or fused tensor."""
    if len(pieces) == 1 and pieces[0].expert is None:
        piece = pieces[0]
        if not piece.transposed:
            return {piece.stored: tensor}
        if isinstance(tensor, DTensor):
            if _local_experts(tensor) is None:
                return None
            shape = (tensor.shape[0], tensor.shape[2], tensor.shape[1])  # given: an uneven split infers it wrong
            stride = torch.empty(shape, device="meta").stride()
            local = tensor.to_local().transpose(1, 2)
            view = DTensor.from_local(local, tensor.device_mesh, tensor.placements, shape=shape, stride=stride)
            return {piece.stored: view}
        return {piece.stored: tensor.transpose(1, 2)}
    local = _local_experts(tensor)
    covered = {(p.expert, p.part) for p in pieces if p.expert is not None}
    parts = pieces[0].parts
    if local is None or covered != {(e, i) for e in range(tensor.shape[0]) for i in range(parts)}:
        return None
    rows, first = local
    width = tensor.shape[1] // parts
    return {
        p.stored: rows[p.expert - first, p.part * width : (p.part + 1) * width]
        for p in pieces
        if first <= p.expert < first + rows.shape[0]
    }


def _targets(model: nn.Module, directory: str | Path) -> dict[str, torch.Tensor] | None:
    """The state-dict entries to load keyed by their names in the directory (tied duplicates once; a fused
    experts' parameter as this rank's views of it, one per stored tensor), or None when some entry has no name
    there. LoRA adapters are not the directory's (`veomni_lite.models.lora` fills them)."""
    prefix, hf_model = hf_child(model)
    names = _checkpoint_names(hf_model, directory)
    seen: set[int] = set()
    targets = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or is_adapter_key(name):
            continue
        seen.add(id(tensor))
        pieces = names.get(name.removeprefix(f"{prefix}."))
        views = None if pieces is None else _views(tensor.detach(), pieces)  # sharing the parameter's storage
        if views is None:
            return None
        targets |= views
    return targets


def loadable(model: nn.Module, directory: str | Path) -> bool:
    """Whether every weight of `model` (on meta or not) is in the directory's safetensors under a known name."""
    return _targets(model, directory) is not None


@torch.no_grad()
def load_into_shards(model: nn.Module, directory: str | Path) -> None:
    """Fill a sharded model fresh from `to_empty`: its parameters from the directory, rank by rank; its unsaved
    buffers recomputed. Collective (DCP plans the read on every rank)."""
    import torch.distributed.checkpoint as dcp

    _, hf_model = hf_child(model)
    for module in hf_model.modules():
        if module._non_persistent_buffers_set:
            hf_model._init_weights(module)
    targets = _targets(model, directory)
    if targets is None:
        raise ValueError(f"{directory}: its weight names do not cover {type(model).__name__} (see loadable())")
    dcp.load(targets, storage_reader=dcp.HuggingFaceStorageReader(str(directory)))


def rank0_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a built model by name, detached: they keep their values after the model itself
    moves to the meta device."""
    return {name: tensor.detach() for name, tensor in (*model.state_dict().items(), *model.named_buffers())}


@torch.no_grad()
def scatter_from_rank0(model: nn.Module, weights: dict[str, torch.Tensor] | None) -> None:
    """Fill a sharded model fresh from `to_empty` with rank 0's `weights` (`rank0_weights`; None on the other ranks):
    each rank keeps its shards of the parameters and persistent buffers, and every other buffer is broadcast whole.
    Collective on the default group, one tensor at a time."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    saved = model.state_dict().keys()
    state = {name: weights[name] for name in saved} if weights is not None else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():
        if name not in saved:  # not saved (rotary frequencies): not in the state dict set above
            if weights is not None:
                buffer.copy_(weights[name])
            dist.broadcast(buffer, src=0)
