"""A tiny Llama-style causal LM: embedding, `num_layers` pre-norm decoder blocks (RoPE attention + SwiGLU), RMSNorm,
untied LM head.

Contract:
- `position_ids` are GLOBAL positions. Under sequence parallelism a rank holds a contiguous slice of each sequence,
  and the rotary embedding is computed from the positions it is given, never from `arange`.
- Each `Attention` module calls its `attention_fn` with q, k, v shaped [B, S, H, D]; `set_attention_fn` swaps it in
  every layer (e.g. for a Ulysses all-to-all wrapper).
- `forward(input_ids, position_ids, labels)` returns `{"foundation_loss": loss}`: the mean cross-entropy over this
  call's valid labels. Labels are already shifted (label t is the target of the prediction at t). With no valid
  label the loss is an exact 0 that keeps the graph, never NaN; nothing is read to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from examples.attention import AttentionFn, causal_attention
from veomni_lite.distributed.sequence_parallel import ulysses_attention
from veomni_lite.models.contract import TrainableModel
from veomni_lite.models.heads import decoder_flops_per_token, masked_mean_cross_entropy

__all__ = [
    "Attention",
    "DecoderBlock",
    "TinyCausalLM",
    "TinyLMConfig",
    "init_linear_and_embedding",
    "rotary_cos_sin",
    "set_attention_fn",
]


@dataclass
class TinyLMConfig:
    vocab_size: int = 32
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 176
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def rotary_cos_sin(position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of shape [B, S, 1, head_dim] for the given (global) positions."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(2)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Multi-head self-attention; the kernel is the replaceable `attention_fn` (see `AttentionFn`)."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.attention_fn: AttentionFn = causal_attention

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = (
            rearrange(p(x), "b s (h d) -> b s h d", h=self.num_heads) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = self.attention_fn(_apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin), v)
        return self.o_proj(rearrange(out, "b s h d -> b s (h d)"))


class SwiGLU(nn.Module):
    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). The unit FSDP shards."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = Attention(config)
        self.post_attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


def set_attention_fn(model: nn.Module, fn: AttentionFn) -> int:
    """Replace `attention_fn` in every `Attention` module of `model`; returns how many were replaced."""
    replaced = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_fn = fn
            replaced += 1
    if replaced == 0:
        raise ValueError(f"set_attention_fn: {type(model).__name__} has no Attention module")
    return replaced


def init_linear_and_embedding(module: nn.Module, std: float) -> None:
    """Normal(0, std) Linear/Embedding weights, zero biases, unit norms; also re-initializes after a meta build."""
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            nn.init.normal_(sub.weight, mean=0.0, std=std)
            if getattr(sub, "bias", None) is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, (nn.RMSNorm, nn.LayerNorm)):
            sub.reset_parameters()


class TinyCausalLM(TrainableModel):
    """Token embedding -> `layers` (nn.ModuleList of DecoderBlock) -> RMSNorm -> untied `lm_head`."""

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        init_linear_and_embedding(self, self.config.initializer_range)

    @property
    def loss_keys(self) -> tuple[str, ...]:
        return ("foundation_loss",)

    def embed(self, input_ids: Tensor) -> Tensor:
        """[B, S] token ids -> [B, S, hidden] embeddings."""
        return self.embed_tokens(input_ids)

    def forward_hidden(self, inputs_embeds: Tensor, position_ids: Tensor) -> Tensor:
        """Run the decoder on [B, S, hidden] embeddings at GLOBAL `position_ids` [B, S]; returns normed hidden."""
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, inputs_embeds.dtype)
        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden, cos, sin)
        return self.norm(hidden)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        labels: Tensor | None = None,
        foundation_loss_weights: Tensor | None = None,
        **unused: Any,
    ) -> dict[str, Tensor]:
        """`{"foundation_loss"}` when `labels` (already shifted) is given, else `{"logits"}`."""
        logits = self.lm_head(self.forward_hidden(self.embed(input_ids), position_ids))
        if labels is None:
            return {"logits": logits}
        return {"foundation_loss": masked_mean_cross_entropy(logits, labels, foundation_loss_weights)}

    def flops_per_token(self, seq_len: int) -> float:
        """Forward+backward FLOPs per token: 6 x matmul params (all but the embedding) + 12 x layers x hidden x seq."""
        return decoder_flops_per_token(
            self, self.config.num_layers, self.config.hidden_size, seq_len, exclude=(self.embed_tokens.weight,)
        )

    def enable_sequence_parallel(self, sp_group: dist.ProcessGroup) -> None:
        """Ulysses attention over `sp_group` in every layer."""
        set_attention_fn(self, ulysses_attention(causal_attention, sp_group))
