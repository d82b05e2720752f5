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

Names are mapped through transformers' own key renamings for the model class (Qwen2-VL directories keep an older
layout). `loadable(model, directory)` says whether every weight is found that way; where a model class's conversions
do more than rename (split or merge tensors), it is not, and rank 0 loads the directory whole and scatters it
(`BaseTrainer.pretrained_model`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

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


def build_on_meta(directory: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model of `directory` (see `pretrained.load_model`) with every parameter and buffer on the meta device, in
    `dtype` (the shards are filled in that dtype, whatever the files store)."""
    config = load_config(directory)
    with torch.device("meta"):
        return family_of(config).build(config, dtype)


def _checkpoint_names(hf_model: Any, directory: str | Path) -> dict[str, str]:
    """{name in the model: name in the directory}, through transformers' own key renamings for this model class
    (e.g. Qwen2-VL's older layout); empty when its conversions do more than rename (split, merge, transpose)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf_model)
    if not all(isinstance(transform, WeightRenaming) for transform in transforms):
        return {}
    meta = hf_model.state_dict()
    prefix = hf_model.base_model_prefix
    return {rename_source_key(name, transforms, [], prefix, meta)[0]: name for name in weight_names(directory)}


def _targets(model: nn.Module, directory: str | Path) -> dict[str, torch.Tensor] | None:
    """The state-dict entries to load keyed by their names in the directory (tied duplicates once), or None when
    some entry has no name there. LoRA adapters are not the directory's (`veomni_lite.models.lora` fills them)."""
    prefix, hf_model = hf_child(model)
    names = _checkpoint_names(hf_model, directory)
    seen: set[int] = set()
    targets = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen or is_adapter_key(name):
            continue
        seen.add(id(tensor))
        stored = names.get(name.removeprefix(f"{prefix}."))
        if stored is None:
            return None
        targets[stored] = tensor.detach()  # shares the parameter's storage
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
