"""Routing replay for mixture-of-experts models: record which experts each token chose, and run a forward that uses
given experts while the router still trains.

`record_routing(model)` is a context manager yielding a list, one entry per MoE layer in module order, filled by the
forwards inside it: that layer's chosen expert indices, [tokens, top_k] int64 (detached, on the model's device;
tokens = the forward's flattened [B, S] in row-major order, this rank's shard under SP). A later forward overwrites
the entries (an activation-checkpointing recompute writes the same values).

`record_every_forward(model)`: the same, keeping every forward's (a generation's prefill and each decode step's):
per MoE layer a list of [tokens, top_k], one per forward in call order.

`replay_routing(model, routing)` is a context manager in which every MoE layer uses the experts `routing[layer]`
([tokens, top_k], e.g. a recording) instead of its own top-k, with routing weights recomputed from this forward's
router logits at those experts by the family's own rule (`ROUTER_SCORES`: softmax of the logits gathered at the
experts, renormalized over them where the family normalizes its top-k, e.g. `norm_topk_prob`; GPT-OSS: softmax of the
gathered logits; DeepSeek-V3: sigmoid, normalized, times `routed_scaling_factor`), so the router gets the gradient
of the replayed choice. Replaying a forward's own recording reproduces that forward exactly. With activation
checkpointing, run the backward inside the context too (the recompute must replay the same experts).

`compact_experts(experts)`: indices in the smallest integer type holding them (uint8 below 256 experts), on the host:
how RL keeps a sample's recorded experts.

`routing_mismatch(a, b, mask)`: (decisions that differ, decisions counted) between two recordings, a decision being
one token's set of experts in one layer (the order within the top-k ignored): the metric `rl/routing/mismatch` is
their ratio, summed over micro-batches and ranks first (a `mean` metric: `record_total`).

Routers are found through transformers' own `_can_record_outputs["router_logits"]` (the class whose output 0 is the
router logits, and which returns (logits, weights, indices)). Covered (`ROUTER_SCORES`): Qwen2-MoE, Qwen3-MoE,
Qwen3-VL-MoE, Mixtral, OLMoE, GPT-OSS, DeepSeek-V3; recording works for any router returning that triple, replay of
another router class is a `ValueError` naming it (add its rule to `ROUTER_SCORES`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROUTED_EXPERTS = "routed_experts"
"""The micro-batch key of a given routing, [B, S, MoE layers, top_k] (sliced under SP like the ids): the experts RL
replays (`rl.routing_replay`) or the old pass chose (`moe.balance: global-batch`'s f, `veomni_lite.models.moe`)."""


def _softmax_scores(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    top = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    return top / top.sum(dim=-1, keepdim=True) if getattr(router, "norm_topk_prob", True) else top


def _softmax_of_chosen_logits(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    return F.softmax(logits.gather(-1, indices), dim=-1, dtype=logits.dtype)


def _sigmoid_scores(router: nn.Module, logits: Tensor, indices: Tensor) -> Tensor:
    top = logits.sigmoid().gather(-1, indices)
    if router.norm_topk_prob:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * router.routed_scaling_factor


# router class name -> the routing weights of given experts from the router logits, as the class computes them for
# its own top-k (each checked against its transformers source: replaying a recording reproduces the forward exactly)
ROUTER_SCORES: dict[str, Callable[[nn.Module, Tensor, Tensor], Tensor]] = {
    "Qwen2MoeTopKRouter": _softmax_scores,  # renormalized where norm_topk_prob
    "Qwen3MoeTopKRouter": _softmax_scores,
    "OlmoeTopKRouter": _softmax_scores,
    "MixtralTopKRouter": _softmax_scores,  # always renormalized (no norm_topk_prob)
    "Qwen3VLMoeTextTopKRouter": _softmax_scores,
    "GptOssTopKRouter": _softmax_of_chosen_logits,
    "DeepseekV3TopkRouter": _sigmoid_scores,
}


def router_classes(model: nn.Module) -> tuple[type, ...]:
    """The router classes transformers records router logits from, over every transformers model inside `model`."""
    classes = set()
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            classes.add(getattr(recorder, "target_class", recorder))
    return tuple(c for c in classes if isinstance(c, type))


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE layers' routers of `model`, in module order (one per MoE layer); empty for a dense model."""
    classes = router_classes(model)
    return [module for module in model.modules() if classes and isinstance(module, classes)]


def _indices(module: nn.Module, output: object) -> Tensor:
    if not (isinstance(output, tuple) and len(output) == 3):
        raise ValueError(f"routing: {type(module).__name__} does not return (logits, weights, indices)")
    return output[2]


@contextlib.contextmanager
def _hooks(model: nn.Module, hook: Callable[[int, nn.Module, object], object]) -> Iterator[list[nn.Module]]:
    layers = routers(model)
    if not layers:
        raise ValueError(f"routing: {type(model).__name__} has no mixture-of-experts router")
    handles = [
        router.register_forward_hook(lambda module, _, output, i=i: hook(i, module, output))
        for i, router in enumerate(layers)
    ]
    try:
        yield layers
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[list[Tensor | None]]:
    """Yield a list that the forwards inside fill with each MoE layer's chosen experts (module docstring)."""
    record: list[Tensor | None] = []

    def keep(layer: int, module: nn.Module, output: object) -> None:
        record[layer] = _indices(module, output).detach()

    with _hooks(model, keep) as layers:
        record.extend([None] * len(layers))
        yield record


@contextlib.contextmanager
def record_every_forward(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Yield a list that the forwards inside fill with each MoE layer's chosen experts of every forward, in call
    order (module docstring)."""
    record: list[list[Tensor]] = []

    def keep(layer: int, module: nn.Module, output: object) -> None:
        record[layer].append(_indices(module, output).detach())

    with _hooks(model, keep) as layers:
        record.extend([] for _ in layers)
        yield record


@contextlib.contextmanager
def replay_routing(model: nn.Module, routing: Sequence[Tensor]) -> Iterator[None]:
    """Inside, every MoE layer routes each token to the experts `routing[layer]` gives (module docstring); a
    `ValueError` names a router class without a rule, a wrong number of layers, or a layer's wrong shape."""
    layers = routers(model)
    unknown = sorted({type(r).__name__ for r in layers} - set(ROUTER_SCORES))
    if unknown:
        raise ValueError(f"routing replay: no rule for the routers {unknown} (add them to ROUTER_SCORES)")
    if len(routing) != len(layers):
        raise ValueError(f"routing replay: {len(routing)} layers of routing for {len(layers)} MoE layers")

    def replay(layer: int, module: nn.Module, output: object) -> tuple[Tensor, Tensor, Tensor]:
        logits, weights, own = output  # type: ignore[misc]
        indices = routing[layer].to(own.device, torch.long)
        if indices.shape != own.shape:
            raise ValueError(
                f"routing replay: layer {layer} routes {tuple(own.shape)} (tokens, top_k), "
                f"the given routing is {tuple(indices.shape)}"
            )
        return logits, ROUTER_SCORES[type(module).__name__](module, logits, indices).to(weights.dtype), indices

    with _hooks(model, replay):
        yield


def compact_experts(experts: torch.Tensor) -> torch.Tensor:
    """Expert indices in the smallest integer type that holds them (uint8 below 256 experts, int16, int32), on the
    host: what a sample keeps."""
    top = int(experts.max()) if experts.numel() else 0
    dtype = torch.uint8 if top < 256 else torch.int16 if top < 2**15 else torch.int32
    return experts.to("cpu", dtype)


def routing_mismatch(a: Sequence[Tensor], b: Sequence[Tensor], mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(differing, counted) token-layer decisions of two recordings of the same tokens (`record_routing`), int64
    scalars: a decision differs when the token's set of experts in that layer differs. `mask` ([tokens] bool): the
    tokens to count (e.g. the response's, not padding); default every token. No host sync."""
    if len(a) != len(b):
        raise ValueError(f"routing_mismatch: {len(a)} layers against {len(b)}")
    differing = torch.zeros((), dtype=torch.long, device=a[0].device if a else None)
    counted = torch.zeros_like(differing)
    for layer, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            raise ValueError(f"routing_mismatch: layer {layer} has shapes {tuple(x.shape)} and {tuple(y.shape)}")
        differs = (x.sort(dim=-1).values != y.to(x.device).sort(dim=-1).values).any(dim=-1)
        keep = torch.ones_like(differs) if mask is None else mask.reshape(-1).to(differs.device, torch.bool)
        differing = differing + (differs & keep).sum()
        counted = counted + keep.sum()
    return differing, counted
