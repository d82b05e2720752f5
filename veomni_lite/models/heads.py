"""What every loss head shares: the local mean over valid targets (from logits, or fused with the LM head's matmul:
`lm_head_loss`), the targets' log-probabilities and entropies the policy and preference heads read (`LogprobRequest`,
`lm_head_logprobs`, fused the same way), and the FLOPs estimate of a decoder (a mixture of experts counted by the
parameters a token runs through)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.fused_ce import linear_cross_entropy, linear_token_logprobs

# Tokens per cross-entropy chunk: a chunk's float32 logits and log-probabilities are the most any head holds at once
# (0: one chunk, the whole micro-batch).
CE_CHUNK_TOKENS = 2048


def _cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def token_cross_entropy(logits: Tensor, labels: Tensor, chunk_tokens: int | None = None) -> Tensor:
    """Per-token cross-entropy (float32, or float64 for float64 logits; 0 where `labels == IGNORE_INDEX`), computed
    `chunk_tokens` (default `CE_CHUNK_TOKENS`) tokens at a time: each chunk is upcast, and recomputed in backward
    rather than kept (activation checkpointing), so no float32 copy of the whole micro-batch's logits is ever held.
    The per-token values are those of one unchunked call."""
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    chunk = CE_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if not chunk or flat_labels.numel() <= chunk:
        return _cross_entropy(flat_logits, flat_labels)
    keep_graph = torch.is_grad_enabled() and flat_logits.requires_grad
    run = functools.partial(checkpoint, _cross_entropy, use_reentrant=False) if keep_graph else _cross_entropy
    # split, not slicing: its backward assembles the chunks' gradients once instead of one full-size tensor per chunk
    return torch.cat([run(x, y) for x, y in zip(flat_logits.split(chunk), flat_labels.split(chunk))])


def masked_mean_cross_entropy(logits: Tensor, labels: Tensor, weights: Tensor | None = None) -> Tensor:
    """Mean over entries with `labels != IGNORE_INDEX` of the cross-entropy, times `weights` where given (the
    per-token weights of a loss mode, `<name>_loss_weights`); an exact graph-keeping 0 when there are none. The
    cross-entropy is chunked over the tokens (`token_cross_entropy`).

    (transformers' own causal-LM loss is NaN on a micro-batch without targets, and divides by its own count.)
    """
    per_token = token_cross_entropy(logits, labels)
    if weights is not None:
        per_token = per_token * weights.reshape(-1).to(per_token.dtype)
    count = (labels != IGNORE_INDEX).sum()
    return per_token.sum() / count.clamp(min=1)


def lm_head_loss(
    head: nn.Module, hidden: Tensor, labels: Tensor, weights: Tensor | None = None, fused: bool = True
) -> Tensor:
    """`masked_mean_cross_entropy(head(hidden), labels, weights)`; for a plain `nn.Linear` head and `fused`, computed
    by `linear_cross_entropy` from its parameters, so the whole logits are never built (`model.fused_lm_head`). Call
    it inside the model's forward (FSDP2 has all-gathered the head there)."""
    if fused and type(head) is nn.Linear:  # a wrapped head (an adapter, say) computes its own logits
        return linear_cross_entropy(hidden, head.weight, labels, weights, head.bias)
    return masked_mean_cross_entropy(head(hidden), labels, weights)


def token_logprobs(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """From whole logits: ([B, S] log-probability of each target under softmax(logits / temperature), 0 where the
    label is ignored; [B, S] entropy of that distribution, or None). Computed in float32 at least."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logp_all = F.log_softmax(logits.to(dtype) / temperature, dim=-1)
    valid = labels != IGNORE_INDEX
    logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    logp = torch.where(valid, logp, 0.0)
    if not entropy:
        return logp, None
    return logp, -(logp_all.exp() * logp_all).sum(-1)


@dataclass(frozen=True)
class LogprobRequest:
    """What a model's forward computes instead of a loss when given `logprobs=LogprobRequest(...)`: the
    log-probability of each of `labels` (shifted like any labels key; IGNORE_INDEX: 0) under softmax(logits /
    `temperature`) and, with `entropy`, that distribution's entropy at every position; with `mean_logits`, the mean
    over the vocabulary of the logits (before `temperature`) at every position, detached (a metric: TRL's
    `logits/*`). See `lm_head_logprobs`."""

    labels: Tensor
    temperature: float = 1.0
    entropy: bool = False
    mean_logits: bool = False


def lm_head_logprobs(head: nn.Module, hidden: Tensor, request: LogprobRequest, fused: bool = True) -> dict[str, Tensor]:
    """{"logprobs": [B, S], "entropy": [B, S] (with `request.entropy`), "mean_logits": [B, S] (with
    `request.mean_logits`, detached)} of `request` (float32 at least, differentiable): `token_logprobs(head(hidden),
    ...)`; for a plain `nn.Linear` head and `fused`, computed chunk by chunk from its parameters
    (`linear_token_logprobs`), so the [tokens, vocab] logits are never whole in memory (their mean over the vocabulary
    is linear in `hidden`: hidden . mean(W) + mean(b), one extra [H] vector). Call it inside the model's forward
    (FSDP2 has all-gathered the head there)."""
    labels = request.labels.to(hidden.device)
    mean_logits = None
    if fused and type(head) is nn.Linear:  # a wrapped head (an adapter, say) computes its own logits
        logp, entropy = linear_token_logprobs(
            hidden, head.weight, labels, head.bias, request.temperature, request.entropy
        )
        if request.mean_logits:
            with torch.no_grad():
                dtype = torch.promote_types(head.weight.dtype, torch.float32)
                mean_logits = hidden.to(dtype) @ head.weight.to(dtype).mean(0)
                mean_logits = mean_logits if head.bias is None else mean_logits + head.bias.to(dtype).mean()
    else:
        logits = head(hidden)
        logp, entropy = token_logprobs(logits, labels, request.temperature, request.entropy)
        if request.mean_logits:
            mean_logits = logits.detach().to(torch.promote_types(logits.dtype, torch.float32)).mean(-1)
    out = {"logprobs": logp}
    out |= {} if entropy is None else {"entropy": entropy}
    return out | ({} if mean_logits is None else {"mean_logits": mean_logits})


def active_shares(model: nn.Module) -> dict[int, float]:
    """{id(parameter): top_k / num_experts} for the routed experts' parameters of every mixture-of-experts block (a
    module with an `experts` child holding `num_experts` and a router child holding `top_k`, as transformers' MoE
    families build them): each token runs only top_k of them. Every other parameter (attention, shared experts,
    router, dense layers) is absent: it runs whole for every token."""
    shares: dict[int, float] = {}
    for block in model.modules():
        experts = getattr(block, "experts", None)
        num_experts = getattr(experts, "num_experts", None)
        top_k = [child.top_k for child in block.children() if isinstance(getattr(child, "top_k", None), int)]
        if not isinstance(experts, nn.Module) or not isinstance(num_experts, int) or len(top_k) != 1:
            continue
        for param in experts.parameters():
            if param.dim() >= 2 and param.shape[0] == num_experts:  # [E, ...]: fused weights and biases
                shares[id(param)] = top_k[0] / num_experts
    return shares


def active_parameters(model: nn.Module, exclude: Iterable[Tensor] = ()) -> float:
    """The parameters a token runs through: every parameter but `exclude`, the routed experts' at their
    `active_shares`."""
    excluded, shares = {id(p) for p in exclude}, active_shares(model)
    return sum(shares.get(id(p), 1.0) * p.numel() for p in model.parameters() if id(p) not in excluded)


def decoder_flops_per_token(
    model: nn.Module, num_layers: int, hidden_size: int, seq_len: int, exclude: Iterable[Tensor] = ()
) -> float:
    """6N + 12 L d T (the PaLM estimate): N = parameters taking part in matmuls, T = sequence length; a routed expert's
    parameters count top_k / num_experts (`active_shares`: the experts a token runs). A frozen parameter (a LoRA base)
    counts 4 (forward, and the gradient of its input; none of its own)."""
    excluded, shares = {id(p) for p in exclude}, active_shares(model)
    matmuls = sum(
        (6 if p.requires_grad else 4) * shares.get(id(p), 1.0) * p.numel()
        for p in model.parameters()
        if id(p) not in excluded
    )
    return float(matmuls + 12 * num_layers * hidden_size * seq_len)
