"""Ulysses sequence parallelism: each sp rank holds a contiguous slice of every sequence.

- `slice_micro_batch` cuts a collated micro-batch (labels already shifted once, globally) along the sequence
  dimension (dim 1) after padding it to a multiple of sp_size (ids with `pad_id`, every labels key with IGNORE_INDEX,
  `image_feature_index` and `sequence_ids` with -1, the `mark_sequences` keys and the RL policy head's per-token
  values (`*_advantages`, `*_logprobs`) and the preference head's `*_margins` with 0, positions continuing, also
  when they carry a trailing axis such as Qwen2-VL's [B, S, 3]). Whole-sample tensors such as `pixel_values` stay
  whole on every rank, and so does a packed row's `attention_sequence_ids` (padded with -1 to the same length): the
  boundaries of the WHOLE row, from which attention masks the rows it sees after the all-to-all.
- `seq_to_heads` / `heads_to_seq` are autograd all-to-alls (`all_to_all_single`) between [B, S/sp, H, D] and
  [B, S, H/sp, D]; each one's backward is the other.
- `ulysses_attention(fn, group)` wraps an attention function with them, so attention sees whole sequences for
  H/sp heads. Rotary embeddings are applied before it from the global `position_ids`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, IGNORE_INDEX, SEQUENCE_IDS, is_labels_key

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


_SEQUENCE_PAD = {"input_ids": None, "position_ids": None, "image_feature_index": -1, SEQUENCE_IDS: -1}
_SEQUENCE_PAD["routed_experts"] = 0  # RL routing replay's [B, S, layers, top_k] experts (`veomni_lite.rl.rollouts`)
# Per-position values of a head, padded with 0: `mark_sequences`' keys, and the RL policy head's per-token values
# (`veomni_lite.rl.policy_loss`: advantages and log-probabilities, in the labels' shifted frame), the critic's old
# values and returns (`veomni_lite.rl.critic`) and the preference head's per-pair margins and KTO labels
# (`veomni_lite.preference.losses`).
_DERIVED_SUFFIXES = (
    "_seq_starts",
    "_loss_weights",
    "_advantages",
    "_logprobs",
    "_margins",
    "_desirable",
    "_old_values",  # not "_values": a VL batch's `pixel_values` are patches, never sliced by position
    "_returns",
)


def is_sequence_key(key: str) -> bool:
    """Keys whose dim 1 is the token sequence: they are padded and sliced under SP."""
    return key in _SEQUENCE_PAD or is_labels_key(key) or key.endswith(_DERIVED_SUFFIXES)


def _pad_value(key: str, pad_id: int) -> int:
    if key == "input_ids":
        return pad_id
    if key.endswith(_DERIVED_SUFFIXES):
        return 0
    return _SEQUENCE_PAD.get(key, IGNORE_INDEX)


def slice_micro_batch(micro_batch: Mapping[str, Any], sp_rank: int, sp_size: int, pad_id: int = 0) -> dict[str, Any]:
    """This sp rank's contiguous slice of every sequence key (see the module docstring); sp_size 1 is a no-op."""
    if sp_size == 1:
        return dict(micro_batch)
    lengths = {key: value.shape[1] for key, value in micro_batch.items() if is_sequence_key(key)}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"slice_micro_batch: sequence keys have different lengths {lengths}")
    if not lengths:
        raise ValueError(f"slice_micro_batch: no sequence keys in micro-batch keys {sorted(micro_batch)}")
    seq_len = next(iter(lengths.values()))
    padded_len = -(-seq_len // sp_size) * sp_size
    chunk = padded_len // sp_size
    start, stop = sp_rank * chunk, (sp_rank + 1) * chunk
    out: dict[str, Any] = {}
    for key, value in micro_batch.items():
        extra = padded_len - seq_len
        if key == ATTENTION_SEQUENCE_IDS:
            out[key] = torch.cat([value, value.new_full((value.shape[0], extra), -1)], dim=1) if extra else value
            continue
        if not is_sequence_key(key):
            out[key] = value
            continue
        if extra:
            if key == "position_ids":
                steps = torch.arange(1, extra + 1, device=value.device, dtype=value.dtype)
                tail = value[:, -1:] + steps.view(1, extra, *[1] * (value.dim() - 2))
            else:
                shape = (value.shape[0], extra, *value.shape[2:])
                tail = torch.full(shape, _pad_value(key, pad_id), dtype=value.dtype, device=value.device)
            value = torch.cat([value, tail], dim=1)
        out[key] = value[:, start:stop].contiguous()
    return out


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """all_to_all_single over dim 0 (one chunk per rank)."""
    x = x.contiguous()  # before empty_like, which would copy a permuted layout that all_to_all ignores
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    sp = dist.get_world_size(group)
    batch, local_seq, heads, dim = x.shape
    if heads % sp:
        raise ValueError(f"sequence parallel: {heads} attention heads are not divisible by sp_size {sp}")
    chunks = x.reshape(batch, local_seq, sp, heads // sp, dim).permute(2, 0, 1, 3, 4)
    gathered = _all_to_all(chunks, group)  # [sp (sequence chunk), B, S/sp, H/sp, D]
    return gathered.permute(1, 0, 2, 3, 4).reshape(batch, sp * local_seq, heads // sp, dim)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    sp = dist.get_world_size(group)
    batch, seq, local_heads, dim = x.shape
    chunks = x.reshape(batch, sp, seq // sp, local_heads, dim).permute(1, 0, 2, 3, 4)
    gathered = _all_to_all(chunks, group)  # [sp (head chunk), B, S/sp, H/sp, D]
    return gathered.permute(1, 2, 0, 3, 4).reshape(batch, seq // sp, sp * local_heads, dim)


class _SeqHeadsAllToAll(torch.autograd.Function):
    """seq -> heads when `to_heads`, else heads -> seq; the backward is the opposite swap."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (_heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)), None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, S/sp, H, D] sequence-sharded -> [B, S, H/sp, D] head-sharded (differentiable)."""
    return _SeqHeadsAllToAll.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[B, S, H/sp, D] head-sharded -> [B, S/sp, H, D] sequence-sharded (differentiable)."""
    return _SeqHeadsAllToAll.apply(x, group, False)


def ulysses_attention(attention_fn: AttentionFn, group: dist.ProcessGroup | None) -> AttentionFn:
    """Wrap `attention_fn` (q, k, v as [B, S, H, D]) so it runs on whole sequences for H/sp heads."""

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = attention_fn(seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group))
        return heads_to_seq(out, group)

    attention.__wrapped__ = attention_fn  # type: ignore[attr-defined]
    return attention
