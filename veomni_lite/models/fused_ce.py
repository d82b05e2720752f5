"""The LM head's matmul fused with its cross-entropy, chunk by chunk of tokens: the [tokens, vocab] logits and their
gradient are never whole in memory.

`linear_cross_entropy(hidden, weight, labels, weights=None, bias=None)` returns exactly what
`masked_mean_cross_entropy(F.linear(hidden, weight, bias), labels, weights)` returns (the mean over this rank's valid
targets of the per-token loss times its loss mode's weight; an exact graph-keeping 0 without targets, never NaN).
`linear_token_cross_entropy` gives the per-token losses it is made of (float32, or float64 for float64 inputs; 0 at
`IGNORE_INDEX`).

How. Forward: per chunk of `chunk_tokens` tokens, the chunk's logits, their log-sum-exp (kept, one float per token)
and the target's loss; only the hidden states, the weight and the log-sum-exps are saved. Backward recomputes each
chunk's logits, turns them in place into (softmax - one-hot) x the token's incoming gradient, and adds that chunk's
share to the gradients of the hidden states, the weight (accumulated in float32 for a bf16 weight) and the bias.
Recomputing rather than computing the gradients in forward (Liger's choice) saves one matmul but holds a
weight-sized gradient from forward to backward and wastes it under `no_grad`; here the step's peak grows by about
two chunks of float32 logits (see docs/benchmarks.md).

Where. Call it inside the model's forward with the head's parameter itself (`lm_head.weight`, or the embedding's for
tied embeddings: autograd adds both uses' gradients into the one parameter), so that FSDP2 has all-gathered it.
Under Ulysses each rank passes its own sequence shard (no collective: the per-token losses are row-local); packed
rows need nothing more (the labels at sample boundaries are already IGNORE_INDEX).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from veomni_lite.loss_keys import IGNORE_INDEX

# A chunk's float32 logits take at most this many bytes (at least one token per chunk): the most the head adds to a
# step's peak is about two such chunks (the logits, and the log-sum-exp's or the matmul's temporary).
FUSED_CE_CHUNK_BYTES = 64 * 2**20


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk: as many as keep one chunk's float32 logits within `FUSED_CE_CHUNK_BYTES`."""
    return max(1, FUSED_CE_CHUNK_BYTES // (4 * vocab_size))


def _logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A chunk's logits as the unfused head computes them: the matmul in the weight's dtype, then upcast to
    float32 (float64 stays float64) for the softmax."""
    logits = F.linear(hidden, weight, bias)
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


class _HeadGrads:
    """The head's input gradients (hidden states, weight, bias: those `needs` asks for), accumulated chunk by chunk
    from each chunk's logits gradient; the weight's and bias's in float32 for a bf16 weight (float64 for float64)."""

    def __init__(self, needs: tuple[bool, ...], hidden: Tensor, weight: Tensor, bias: Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.accumulate = torch.float64 if weight.dtype == torch.float64 else torch.float32
        self.hidden = torch.empty_like(hidden) if needs[0] else None
        self.weight_grad = torch.zeros(weight.shape, dtype=self.accumulate, device=weight.device) if needs[1] else None
        self.bias_grad = torch.zeros(bias.shape, dtype=self.accumulate, device=bias.device) if needs[2] else None

    def add(self, rows: slice, grad: Tensor, h: Tensor) -> None:
        """Chunk `rows` (hidden states `h`) with `grad`, d loss / d logits, in the weight's dtype."""
        if self.hidden is not None:
            self.hidden[rows] = grad @ self.weight
        if self.weight_grad is not None:
            if grad.dtype == self.accumulate:
                self.weight_grad.addmm_(grad.t(), h)
            else:
                self.weight_grad.add_(grad.t() @ h)
        if self.bias_grad is not None:
            self.bias_grad.add_(grad.sum(0))

    def result(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        weight = None if self.weight_grad is None else self.weight_grad.to(self.weight.dtype)
        bias = None if self.bias_grad is None else self.bias_grad.to(self.bias.dtype)
        return self.hidden, weight, bias


class _LinearCrossEntropy(torch.autograd.Function):
    """hidden [N, H], weight [V, H], bias [V] or None, labels [N] -> per-token losses [N] (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, chunk: int) -> Tensor:
        loss_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        losses = hidden.new_empty(labels.shape[0], dtype=loss_dtype)
        lse = torch.empty_like(losses)
        for start in range(0, labels.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits, targets = _logits(hidden[rows], weight, bias), labels[rows]
            lse[rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
            losses[rows] = torch.where(targets != IGNORE_INDEX, lse[rows] - picked, 0.0)
            del logits
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        return losses

    @staticmethod
    def backward(ctx, grad_losses: Tensor):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        grads = _HeadGrads(ctx.needs_input_grad[:3], hidden, weight, bias)
        for start in range(0, labels.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h, targets = hidden[rows], labels[rows]
            valid = targets != IGNORE_INDEX
            # d loss_t / d logits_t = softmax(logits_t) - onehot(target_t), built in place in the logits' buffer
            grad = _logits(h, weight, bias).sub_(lse[rows, None]).exp_()
            grad.scatter_add_(1, targets.clamp(min=0)[:, None], -valid.to(grad.dtype)[:, None])  # no host read
            grad.mul_(torch.where(valid, grad_losses[rows], 0.0).to(grad.dtype)[:, None])
            grads.add(rows, grad.to(weight.dtype), h)
            del grad
        return *grads.result(), None, None


def linear_token_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None = None, chunk_tokens: int | None = None
) -> Tensor:
    """Per-token cross-entropy of `F.linear(hidden, weight, bias)` against `labels` ([..., H] and [...] -> [N]
    flattened; 0 where `labels == IGNORE_INDEX`), chunked over the tokens (default `default_chunk_tokens`)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"fused LM head: hidden {list(hidden.shape)} does not match labels {list(labels.shape)}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    flat_labels = labels.reshape(-1).to(hidden.device)
    return _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, flat_labels, chunk)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    weights: Tensor | None = None,
    bias: Tensor | None = None,
    chunk_tokens: int | None = None,
) -> Tensor:
    """`masked_mean_cross_entropy(F.linear(hidden, weight, bias), labels, weights)` without the whole logits: the
    mean over entries with `labels != IGNORE_INDEX` of the cross-entropy times `weights` where given (a loss mode's
    per-token weights, `<name>_loss_weights`); an exact graph-keeping 0 when there are none."""
    per_token = linear_token_cross_entropy(hidden, weight, labels, bias, chunk_tokens)
    if weights is not None:
        per_token = per_token * weights.reshape(-1).to(per_token.dtype)
    count = (labels != IGNORE_INDEX).sum()
    return per_token.sum() / count.clamp(min=1)


class _LinearLogprobs(torch.autograd.Function):
    """hidden [N, H], weight [V, H], bias [V] or None, labels [N] -> (log-probability of each target under
    softmax(logits / temperature), that distribution's entropy or an empty tensor), each allocated in `shape` (N
    elements) rather than a view of a flat result: FSDP2 warns of a module output that is a view (an in-place op on it
    would skip the pre-backward hook); see `linear_token_logprobs`."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, labels: Tensor, temperature: float, chunk: int,
        entropy: bool, shape: torch.Size,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        count = labels.shape[0]
        shaped_logp = hidden.new_empty(shape, dtype=dtype)
        shaped_entropies = torch.empty_like(shaped_logp) if entropy else shaped_logp.new_empty(0)
        logp, entropies = shaped_logp.view(-1), shaped_entropies.view(-1)  # written through these flat views
        lse = torch.empty_like(logp)
        for start in range(0, count, chunk):
            rows = slice(start, start + chunk)
            z, targets = _logits(hidden[rows], weight, bias), labels[rows]
            if temperature != 1.0:
                z.div_(temperature)
            picked = z.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
            if entropy:  # one exp for both: lse = m + log sum e, H = lse - sum_v p_v z_v, e = exp(z - m)
                top = z.amax(dim=-1, keepdim=True)
                e = (z - top).exp_()
                total = e.sum(-1)
                lse[rows] = top.squeeze(1) + total.log()
                entropies[rows] = lse[rows] - e.mul_(z).sum(-1) / total
                del e
            else:
                lse[rows] = torch.logsumexp(z, dim=-1)
            logp[rows] = torch.where(targets != IGNORE_INDEX, picked - lse[rows], 0.0)
            del z
        ctx.chunk, ctx.temperature, ctx.entropy = chunk, temperature, entropy
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, lse, shaped_entropies)
        return shaped_logp, shaped_entropies

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, labels, lse, entropies = ctx.saved_tensors
        entropies = entropies.reshape(-1)
        grad_logp = None if grad_logp is None else grad_logp.reshape(-1)
        grad_entropy = None if grad_entropy is None or not ctx.entropy else grad_entropy.reshape(-1)
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None
        grads = _HeadGrads(ctx.needs_input_grad[:3], hidden, weight, bias)
        temperature = ctx.temperature
        for start in range(0, labels.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            h, targets = hidden[rows], labels[rows]
            valid = targets != IGNORE_INDEX
            g_logp = lse.new_zeros(h.shape[0]) if grad_logp is None else grad_logp[rows]
            g_logp = torch.where(valid, g_logp, 0.0).to(lse.dtype)
            # d logp / dz = onehot - p;  d H / dz = -p (log p + H); built in place in the chunk's logits buffer
            log_p = _logits(h, weight, bias)
            if temperature != 1.0:
                log_p.div_(temperature)
            log_p.sub_(lse[rows, None])
            if grad_entropy is not None:
                g_entropy = grad_entropy[rows].to(lse.dtype)[:, None]
                grad = log_p.exp()
                grad.mul_(log_p.add_(entropies[rows, None]).mul_(g_entropy).add_(g_logp[:, None])).neg_()
            else:
                grad = log_p.exp_().mul_(-g_logp[:, None])
            del log_p
            grad.scatter_add_(1, targets.clamp(min=0)[:, None], g_logp[:, None])  # no host read
            if temperature != 1.0:
                grad.div_(temperature)
            grads.add(rows, grad.to(weight.dtype), h)
            del grad
        return *grads.result(), None, None, None, None, None


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The policy and preference heads' inputs without the whole logits: ([...] log-probability of each target under
    softmax(F.linear(hidden, weight, bias) / temperature), 0 where `labels == IGNORE_INDEX`; [...] that
    distribution's entropy at every position, or None), float32 (float64 for a float64 weight), both differentiable,
    chunked over the tokens like `linear_token_cross_entropy` (the entropy's backward runs only when it is used)."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"fused LM head: hidden {list(hidden.shape)} does not match labels {list(labels.shape)}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    flat_labels = labels.reshape(-1).to(hidden.device)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    logp, entropies = _LinearLogprobs.apply(
        flat_hidden, weight, bias, flat_labels, temperature, chunk, entropy, labels.shape
    )
    return logp, entropies if entropy else None
