"""FSDP2 (`fully_shard`) over the dp x sp mesh: each transformer block, then the root.

Gradients are averaged over all dp x sp ranks, which is the W that `mean_global_loss` scales by.

Expert parallelism (`state.ep_size` > 1): each block's experts modules are split over the ep group first
(`expert_parallel.shard_experts`) and `fully_shard`-ed on their own over "efsdp", dividing their gradients by the same
W (see `veomni_lite.distributed.expert_parallel`).

Sharded parameters. FSDP2 registers a module's parameters as sharded DTensors, swaps in gathered plain Parameters for
a forward and swaps the shards back when it reshards. The root module does not reshard after a forward (it expects
the backward to follow), so after a forward outside training (a reference pass, a warm-up, an evaluation) the root's
parameters (embeddings, final norm, LM head) are plain gathered tensors until the next backward. Whoever collects
`model.parameters()` then (an optimizer, a reference copy) gets those, never updated by FSDP: `reshard` first, and
`check_sharded` what was collected.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from veomni_lite.distributed.expert_parallel import check_expert_parallel, expert_modules, shard_experts
from veomni_lite.distributed.parallel_state import ParallelState


def resolve_mixed_precision(setting: str, device: torch.device) -> bool:
    """ "auto" means bf16 on CUDA and fp32 elsewhere; "bf16" off CUDA is refused (gloo/CPU trains in fp32)."""
    if setting == "auto":
        return device.type == "cuda"
    if setting == "bf16" and device.type != "cuda":
        raise ValueError(f"parallel.mixed_precision: bf16 needs a CUDA device, this run is on {device.type}")
    return setting == "bf16"


def apply_fsdp(model: nn.Module, state: ParallelState, blocks: list[nn.Module], bf16: bool = False) -> nn.Module:
    """Shard `blocks` one by one, then the root, over the 1-D dp x sp mesh; with `state.ep_size` > 1 each block's
    experts first over the ep group and "efsdp" (a ConfigError before any collective where the model has none to
    split, `check_expert_parallel`). Single process: returned unchanged."""
    mesh = state.fsdp_mesh()
    if mesh is None:
        return model
    check_expert_parallel(model, state.ep_size)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}
    if state.ep_mesh is not None:
        shard_experts(model, state)
    for block in blocks:
        for experts in expert_modules(block) if state.ep_mesh is not None else ():
            fully_shard(experts, **{**kwargs, "mesh": state.ep_mesh[_EXPERT_DATA_DIMS[state.ep_mesh.ndim]]})
            experts.set_force_sum_reduction_for_comms(
                True
            )  # a factor but the group's size is a PREMUL_SUM: not on gloo
            experts.set_gradient_divide_factor(_divide_factor(state))
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


_EXPERT_DATA_DIMS = {2: "efsdp", 3: ("replicate", "efsdp")}  # the experts' FSDP2 (HSDP) mesh in `state.ep_mesh`


def _divide_factor(state: ParallelState) -> float:
    """The factor that makes FSDP2 (with sum-only reductions) divide the experts' gradients by the world size. torch
    2.13's FSDP2 sharding over one rank (efsdp 1: ep_size = the shard block) divides by the factor twice: sqrt(world)
    there."""
    if state.world_size // state.dp_replicate == state.ep_size:
        return math.sqrt(state.world_size)
    return float(state.world_size)


def set_gradient_sync(model: nn.Module, last: bool, every_micro_batch: bool = True) -> None:
    """Before each micro-batch: `every_micro_batch` reduce-scatters every micro-batch (sharded gradients accumulate)
    and runs HSDP's replica all-reduce on the `last` only; otherwise both run on the last micro-batch only, and the
    gradients accumulate unsharded until then."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last or every_micro_batch, recurse=True)
        model.set_requires_all_reduce(last, recurse=True)


def reshard(model: nn.Module) -> None:
    """Every FSDP2 module of `model` back to its shards, so `model.parameters()` yields the sharded DTensors again
    (see the module docstring; a no-op without FSDP). Local: no collective."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def check_sharded(model: nn.Module, params: Iterable[torch.Tensor], what: str = "the optimizer") -> None:
    """Raise RuntimeError naming each trainable parameter in `params` that is not the sharded DTensor FSDP2 updates
    (under FSDP; a no-op without it): one collected while the model was gathered, without `reshard`."""
    if not isinstance(model, FSDPModule):
        return
    names = {id(param): name for name, param in model.named_parameters()}
    unsharded = [
        names.get(id(param), f"<a tensor of shape {tuple(param.shape)} outside the model>")
        for param in params
        if param.requires_grad and not isinstance(param, DTensor)
    ]
    if unsharded:
        raise RuntimeError(
            f"{what} holds {len(unsharded)} gathered, unsharded parameter(s) of the FSDP model, which would never "
            f"train: {unsharded}; call veomni_lite.distributed.fsdp.reshard(model) after a forward outside training"
        )


def checkpoint_activations(blocks: list[nn.Module]) -> None:
    """Recompute each block's forward in backward (non-reentrant activation checkpointing), before `fully_shard`."""
    for block in blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
