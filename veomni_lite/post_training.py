"""What online RL (`veomni_lite.rl`) and preference training (`veomni_lite.preference`) share: sums over a whole
sequence, exact under packing and Ulysses SP, and the frozen reference policy. (The third shared piece, the targets'
log-probabilities, is the model's: `veomni_lite.models.heads.LogprobRequest`, fused with the LM head.)

Sequence sums. A sequence is a sample: a row when padded, a segment of a packed row, marked by `sequence_ids` (-1: none)
before SP slicing, so every shard of a sequence carries the same id. `sequence_sums(values, sequence_ids, sp_group)`
gives each position the sum of `values` over its whole sequence: the shard-local sums (one slot per sequence of the
row), then, under SP, ONE autograd all-reduce over the SP group, whose backward sums the shards' gradients, so a
nonlinearity of the sum (GSPO's sequence ratio, DPO's sigmoid) sees the complete sum on every shard and trains every
shard's tokens. The buffer has a slot per position of the whole row (or per row, where a padded micro-batch has more
rows than positions), the same size on every shard, so the shards always match. `sequence_totals(values,
sequence_ids, sp_group)` gives the same complete sums by sequence id instead of by position (channels stacked, so
several sums cost one all-reduce): what needs a sequence's sum where none of its positions lies, e.g. a preference
pair's other side, in another row or on another SP shard. It needs ids unique in the micro-batch, as the collators
write them (a padded row's id is its row; a packed row numbers its samples).

The reference: the initial weights, held sharded like the policy's, swapped in for its forwards.
`ReferenceWeights(model)` clones this rank's shards of every parameter that trains (the policy's FSDP2 shards: about
1/dp of a whole copy per rank); `with reference.active():` swaps them into the model in place and back afterwards, so
the reference forward is the policy's own forward (same sharding, same collectives) on other values, and no second model
is built. Every FSDP2 module is resharded around the swap, so no gathered copy of the other values is used. Under LoRA
nothing is cloned: the base is frozen, so the reference is the model with its adapters off (`LoraLinear.scaling` 0
inside the block). Built before a checkpoint is loaded, so a resumed run rebuilds it from the same initial weights
instead of saving it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce as autograd_all_reduce

from veomni_lite.distributed.fsdp import check_sharded, reshard
from veomni_lite.models.lora import LoraLinear

__all__ = ["ReferenceWeights", "sequence_sums", "sequence_totals"]


def sequence_sums(
    values: torch.Tensor, sequence_ids: torch.Tensor, sp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """[B, S] `values` -> [B, S]: at each position of a sequence, that sequence's sum over every shard (0 where
    `sequence_ids` < 0). Differentiable; collective over `sp_group` when it has more than one rank (call it on every
    shard alike)."""
    if values.shape != sequence_ids.shape:
        raise ValueError(f"sequence_sums: values {tuple(values.shape)} and sequence_ids {tuple(sequence_ids.shape)}")
    sp = dist.get_world_size(sp_group) if sp_group is not None else 1
    rows, length = values.shape
    # Ids as the collators write them: a padded row's is its row (< rows), a packed row's number its samples (each
    # holds a position of the whole row: < length * sp). Shapes only, so every SP shard makes the same buffer.
    slots = max(length * sp, rows)
    valid = sequence_ids >= 0
    row = torch.arange(rows, device=values.device).unsqueeze(1)
    index = (row * slots + sequence_ids.clamp(min=0)).reshape(-1)
    local = values.new_zeros(rows * slots).index_add(0, index, torch.where(valid, values, 0).reshape(-1))
    total = autograd_all_reduce(local, group=sp_group) if sp > 1 else local
    return torch.where(valid, total[index].view_as(values), 0)


def sequence_totals(
    values: torch.Tensor, sequence_ids: torch.Tensor, sp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """[K, B, S] `values` (K channels) -> [K, B * S * sp]: entry [k, i] is channel k's sum over sequence id i on every
    shard (0 for an id without positions). Ids must be unique in the micro-batch (see the module docstring).
    Differentiable; ONE all-reduce over `sp_group` when it has more than one rank (call it on every shard alike)."""
    if values.shape[1:] != sequence_ids.shape:
        raise ValueError(f"sequence_totals: values {tuple(values.shape)} and sequence_ids {tuple(sequence_ids.shape)}")
    sp = dist.get_world_size(sp_group) if sp_group is not None else 1
    slots = sequence_ids.numel() * sp  # a sequence holds a position of the whole micro-batch: ids < B * S * sp
    valid = (sequence_ids >= 0).reshape(-1)
    index = sequence_ids.clamp(min=0).reshape(-1)
    flat = torch.where(valid, values.reshape(values.shape[0], -1), 0)
    local = values.new_zeros(values.shape[0], slots).index_add(1, index, flat)
    return autograd_all_reduce(local, group=sp_group) if sp > 1 else local


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's storage of a parameter (a DTensor's local shard)."""
    return param.to_local() if hasattr(param, "to_local") else param


class ReferenceWeights:
    """See the module docstring."""

    def __init__(self, model: nn.Module, skip: Iterable[nn.Parameter] = ()) -> None:
        """`skip`: parameters that are not the policy's (PPO's critic), kept as they are."""
        self.model = model
        skipped = {id(p) for p in skip}
        self.adapters = [module for module in model.modules() if isinstance(module, LoraLinear)]
        reshard(model)  # the shards, whatever forward ran before
        trained = [p for p in model.parameters() if p.requires_grad and id(p) not in skipped]
        self.params = [] if self.adapters else trained
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
