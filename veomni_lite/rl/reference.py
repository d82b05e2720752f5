"""The frozen reference policy: the initial weights, held sharded like the policy's, swapped in for its forwards.

`ReferenceWeights(model)` clones this rank's shards of every parameter that trains (the policy's FSDP2 shards: about
1/dp of a whole copy per rank); `with reference.active():` swaps them into the model in place and back afterwards,
so the reference forward is the policy's own forward (same sharding, same collectives) on other values, and no second
model is built. Every FSDP2 module is resharded around the swap, so no gathered copy of the other values is used.
Under LoRA nothing is cloned: the base is frozen, so the reference is the model with its adapters off
(`LoraLinear.scaling` 0 inside the block). Built before a checkpoint is loaded, so a resumed run rebuilds it from the
same initial weights instead of saving it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from veomni_lite.distributed.fsdp import check_sharded, reshard
from veomni_lite.models.lora import LoraLinear

__all__ = ["ReferenceWeights"]


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a parameter (a DTensor's local shard)."""
    return param.to_local() if hasattr(param, "to_local") else param


class ReferenceWeights:
    """See the module docstring."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.adapters = [module for module in model.modules() if isinstance(module, LoraLinear)]
        reshard(model)  # the shards, whatever forward ran before
        self.params = [] if self.adapters else [p for p in model.parameters() if p.requires_grad]
        check_sharded(model, self.params, "the reference")
        with torch.no_grad():
            self.values = [_local(p).detach().clone() for p in self.params]

    @property
    def bytes(self) -> int:
        """Memory held by the reference on this rank."""
        return sum(v.numel() * v.element_size() for v in self.values)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The model computes with the reference weights inside the block (not differentiable; restored on exit)."""
        if self.adapters:
            scales = [module.scaling for module in self.adapters]
            for module in self.adapters:
                module.scaling = 0.0
            try:
                yield
            finally:
                for module, scale in zip(self.adapters, scales):
                    module.scaling = scale
            return
        # FSDP2's root keeps its gathered parameters after a forward (see veomni_lite.distributed.fsdp): those would
        # not see a swap of the shards
        reshard(self.model)
        self._swap()
        try:
            yield
        finally:
            reshard(self.model)
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for param, value in zip(self.params, self.values):
            local = _local(param)
            held = local.clone()
            local.copy_(value)
            value.copy_(held)
