"""Expert parallelism (`parallel.ep_size`): each MoE layer's routed experts split over the "ep" ranks of the mesh.

What is sharded. transformers 5 holds a layer's routed experts as fused 3-D parameters (`gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I], in classes decorated with `use_experts_implementation`: Qwen3-MoE, Qwen3-VL-MoE, Qwen2-MoE,
Mixtral, OLMoE, DeepSeek-V3). `shard_experts` makes each a DTensor `Shard(0)` over the ep group (ep rank r holds
experts [r E/ep, (r + 1) E/ep)), and `apply_fsdp` then `fully_shard`s the experts module over "efsdp" (the ranks that
hold the same experts; FSDP2 composes the two into one 2-D DTensor), so a rank stores E / world of the experts and
all-gathers only its ep group's E / ep for a forward. A checkpoint (DCP) and `full_tensor()` see the whole [E, ...]
parameter, whatever the ep size: a run resumes at another ep size, export and weight sync get whole experts.

The forward (`ep_forward`, installed on each experts module). A layer's (token, slot) pairs are sorted by expert;
one all-to-all of the per-expert counts tells each rank how many rows it receives, one all-to-all
(`all_to_all_single` with those split sizes) sends each row to its expert's rank, the rank runs its local experts
grouped (rows sorted by local expert; `torch._grouped_mm` where it takes the dtype, else one padded `bmm`: never a
loop over experts), and one all-to-all returns the rows; the routing weights multiply on the token's own rank, so
the router's gradient stays local. Per MoE layer: 3 all-to-alls forward (counts, rows, rows back), 2 backward; their
number is the layers', the same on every rank whatever the routing (an empty micro-batch or a rank without a row
for some expert included).

Gradients. The all-to-all's backward sums every rank's contribution to an expert's gradient on its owner; FSDP2's
reduce-scatter over "efsdp" sums the owners' copies; the experts' FSDP module divides by the world size
(`set_gradient_divide_factor`), the factor every other parameter's FSDP2 divides by: the experts' gradients equal
those of ep_size 1.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from veomni_lite.distributed.parallel_state import ParallelState

__all__ = [
    *("EXPERT_PARAMS", "check_expert_parallel", "ep_forward", "expert_bytes", "expert_modules", "grouped_linear"),
    "shard_experts",
]

EXPERT_PARAMS = ("gate_up_proj", "down_proj")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch's grouped_mm takes


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The fused routed-experts modules of `model` (transformers' `use_experts_implementation` classes), in order."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "_is_expert_parallel")
        and all(isinstance(getattr(module, name, None), nn.Parameter) for name in EXPERT_PARAMS)
    ]


def check_expert_parallel(model: nn.Module, ep_size: int) -> None:
    """Raise ValueError (every rank alike: from the model and config, before any collective; the trainer raises it as
    a ConfigError) naming what cannot be split over `ep_size` ranks: a model without fused experts, a layer whose
    number of experts ep_size does not divide, experts with biases or a post-expert norm (GPT-OSS)."""
    if ep_size == 1:
        return
    modules = expert_modules(model)
    if not modules:
        raise ValueError(
            f"parallel.ep_size ({ep_size}): {type(model).__name__} has no fused routed experts (not a mixture of "
            "experts transformers holds as 3-D gate_up_proj / down_proj); set parallel.ep_size 1"
        )
    for module in modules:
        experts = module.gate_up_proj.shape[0]
        if experts % ep_size:
            raise ValueError(
                f"parallel.ep_size ({ep_size}) does not divide the {experts} experts of {type(module).__name__}: "
                "each ep rank holds the same number of whole experts"
            )
        if module.has_bias or module.has_post_expert_norm or not module.has_gate:
            raise ValueError(
                f"parallel.ep_size ({ep_size}): {type(module).__name__}'s experts (biases, a post-expert norm or no "
                "gate) are not supported under expert parallelism; set parallel.ep_size 1"
            )


def expert_bytes(model: nn.Module, ep_size: int) -> tuple[int, int]:
    """(the bytes of the routed experts this rank stores: its shards, E / world of every layer's under FSDP2 at any
    ep size; the bytes one MoE layer's forward holds whole after FSDP2's all-gather: its E / ep_size experts, the
    largest layer's). Local: no collective."""
    stored = gathered = 0
    for module in expert_modules(model):
        params = [getattr(module, name) for name in EXPERT_PARAMS]
        stored += sum(_local(p).numel() * p.element_size() for p in params)
        gathered = max(gathered, sum(p.numel() // ep_size * p.element_size() for p in params))
    return stored, gathered


def shard_experts(model: nn.Module, state: ParallelState) -> list[nn.Module]:
    """Split every experts module's fused parameters over the ep group (DTensor `Shard(0)`: this rank keeps its rows
    of the values it holds, or meta stays meta) and install `ep_forward`; returns the modules. Local: no collective.
    Call before `fully_shard` (`apply_fsdp` does)."""
    mesh = state.ep_mesh["ep"]
    ep, rank = state.ep_size, state.ep_rank
    modules = expert_modules(model)
    for module in modules:
        for name in EXPERT_PARAMS:
            param = getattr(module, name)
            rows = param.shape[0] // ep
            local = param.detach()[rank * rows : (rank + 1) * rows].clone()
            sharded = DTensor.from_local(local, mesh, [Shard(0)], shape=param.shape, stride=param.stride())
            setattr(module, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.ep_group = state.ep_group
        module.forward = types.MethodType(ep_forward, module)
    return modules


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` of rows with split sizes; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _AllToAll.apply(grad, *ctx.splits, ctx.group), None, None, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows `x` [N, in] sorted by expert (`counts` [E] rows each) through their expert's `weight` ([E, out, in], or
    [E, in, out] when `transposed`): `torch._grouped_mm` for the dtypes it takes, else one zero-padded `bmm` (float64:
    exact, every row's product alone)."""
    w = (weight if transposed else weight.transpose(1, 2)).to(x.dtype)  # [E, in, out]
    if _grouped_mm_takes(x, w):
        return torch._grouped_mm(x, w, offs=torch.cumsum(counts, 0, dtype=torch.int32))
    experts = counts.numel()
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=x.shape[0])
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[expert]
    longest = int(counts.max()) if experts else 0
    padded = x.new_zeros((experts, longest, x.shape[1])).index_put((expert, slot), x)
    return torch.bmm(padded, w)[expert, slot]


def _grouped_mm_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands: its dtypes, a CUDA device of compute capability 8.0+ (or the
    CPU), 16-byte aligned data and strides, and at least one row (its backward fails on none: a rank no row was sent
    to runs the padded bmm of nothing)."""
    if not x.shape[0]:
        return False
    if x.dtype not in _GROUPED_DTYPES or (
        x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 0)
    ):
        return False
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride() if s != 1) for t in (x, w)
    )


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def ep_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts' forward under expert parallelism (see the module docstring): `hidden_states` [T, H] and their
    top-k experts and weights [T, k] of this rank in, the weighted sum of their experts' outputs [T, H] out.
    Collective over `self.ep_group`: 3 all-to-alls (2 in backward), whatever the routing."""
    group = self.ep_group
    ep = dist.get_world_size(group)
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    local_experts = gate_up.shape[0]
    experts = local_experts * ep
    tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # (token, slot) pairs grouped by expert, so by destination rank
    counts = torch.bincount(expert_ids, minlength=experts)
    received = torch.empty_like(counts)  # [source rank x local expert]: the rows each rank sends each local expert
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, local_experts)
    send, recv = counts.view(ep, local_experts).sum(1).tolist(), received.sum(1).tolist()  # the one host read
    rows = _AllToAll.apply(hidden_states[order // top_k], recv, send, group)  # by source rank, then local expert
    local_ids = torch.arange(local_experts, device=rows.device).repeat(ep)
    by_expert = torch.argsort(
        torch.repeat_interleave(local_ids, received.reshape(-1), output_size=rows.shape[0]), stable=True
    )
    per_expert = received.sum(0)
    out = grouped_linear(rows[by_expert], gate_up, per_expert, self.is_transposed)
    out = grouped_linear(self._apply_gate(out), down, per_expert, self.is_transposed)
    out = _AllToAll.apply(out[torch.argsort(by_expert)], send, recv, group)  # back, in `order`
    out = out[torch.argsort(order)].view(tokens, top_k, -1)
    return (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(1).to(hidden_states.dtype)
