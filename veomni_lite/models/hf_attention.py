"""Ulysses sequence parallelism for transformers models, through their attention registry (no model code edited).

`enable_ulysses(text_config, attention_modules, sp_group, ...)` registers `ulysses_attention_forward` under the name
`veomni_ulysses` in transformers' `AttentionInterface`, points the decoder's config at it, and tells each attention
module its sp group. transformers calls the function with this rank's shard: `query` [B, H, s, D] and `key`/`value`
[B, H_kv, s, D] (rotary already applied from the GLOBAL positions the trainer passes), and expects ([B, s, H, D],
None). The function swaps sequence for heads with two autograd all-to-alls around causal attention over the whole
sequence, so H and H_kv must be divisible by sp_size: SDPA, or, where the decoder was set to flash-attention, that
varlen kernel (registered as `veomni_ulysses_<kernel>`). No mask is needed unpacked: padding is on the right only,
so the causal mask suffices. A vision tower keeps its own attention: it sees whole images on every rank.

Packed rows: `packed_attention_inputs` turns a packed row's `attention_sequence_ids` (the host tensor the collator
wrote; models list it in `host_inputs`) into what the attention takes, with no position read back from the device.
For SDPA and `veomni_ulysses`: `packed_causal_mask`, the block-diagonal causal mask of the WHOLE row, moved to the
device and built there; given as a 4D mask, transformers passes it through unchanged to SDPA and to `veomni_ulysses`,
which applies it after the all-to-all, where each rank sees the whole row. For flash-attention (`VARLEN_ATTENTION`,
and Ulysses around it): no mask, and the whole row's boundaries as `cu_seq_lens_q/k` (int32; the padding after the
samples is a sequence of its own) with `max_length_q/k` (ints), computed on the host, which transformers hands to
the varlen kernel as they are (after the all-to-all under Ulysses).
`check_packing_attention` refuses other implementations (eager adds a mask of its own) and, outside flash-attention,
sliding-window layers (a 4D mask replaces the window). The models call `decoder_attention_inputs`, which first routes
the decoder's attention through `ulysses_attention_forward` (`route_attention`; without an sp group it is SDPA or the
varlen kernel alone) for any architecture, so transformers' mask code and its device read of the position ids
(`find_packed_sequence_indices`, a host sync per forward on an accelerator) never run.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from veomni_lite.distributed.sequence_parallel import heads_to_seq, seq_to_heads

ATTENTION_NAME = "veomni_ulysses"
_GROUP_ATTR = "veomni_sp_group"


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    inner: str = "sdpa",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; see the module docstring for the layouts. `attention_mask`: None
    (causal) or a packed row's [B, 1, S, S] boolean mask over the whole sequence. `inner`: the attention run after
    the all-to-all, SDPA or a varlen kernel (`VARLEN_ATTENTION`), which takes the whole row's boundaries in `kwargs`."""
    group = getattr(module, _GROUP_ATTR, None)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, s, H, D]
    if group is not None:
        q, k, v = seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)  # [B, S, H/sp, D]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if inner != "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        kwargs.pop("position_ids", None)  # this rank's shard: the kernel gets the whole row's boundaries, or none
        out = ALL_ATTENTION_FUNCTIONS[inner](module, q, k, v, None, dropout=dropout, scaling=scaling, **kwargs)[0]
        return (out if group is None else heads_to_seq(out.contiguous(), group)).contiguous(), None
    repeats = q.shape[1] // k.shape[1]
    if repeats > 1:  # grouped-query attention: transformers hands over the un-expanded key/value heads
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attention_mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        is_causal=attention_mask is None,
    ).transpose(1, 2)  # [B, S, H/sp, D]
    if group is not None:
        out = heads_to_seq(out.contiguous(), group)
    return out.contiguous(), None


def packed_causal_mask(sequence_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: query q may attend key k iff k <= q and both hold the same id (padding, -1, attends only to
    the padding before it, so no row is empty)."""
    length = sequence_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=sequence_ids.device).tril()
    return ((sequence_ids[:, :, None] == sequence_ids[:, None, :]) & causal)[:, None]


VARLEN_ATTENTION = {"flash_attention_2", "flash_attention_3", "flash_attention_4"}  # take cu_seq_lens, no mask
PACKING_ATTENTION = ("sdpa", ATTENTION_NAME)


def check_packing_attention(config: Any) -> None:
    """Raise ValueError unless `config`'s attention keeps a packed row's samples apart (see the module docstring)."""
    name = getattr(config, "_attn_implementation", None)
    if name not in PACKING_ATTENTION and not _varlen(name):
        choices = (*PACKING_ATTENTION, *sorted(VARLEN_ATTENTION))
        raise ValueError(
            f"data.packing: attention {name!r} cannot keep the packed rows' samples apart; use one of {choices}"
        )
    if not _varlen(name) and _sliding_layers(config):
        raise ValueError(f"data.packing: sliding-window layers need flash-attention (attention {name!r} would drop it)")


def _varlen(name: str | None) -> bool:
    """Whether attention `name` takes packed rows as flash-attention does (boundaries, no mask), alone or in Ulysses."""
    return name in VARLEN_ATTENTION or (name or "").removeprefix(f"{ATTENTION_NAME}_") in VARLEN_ATTENTION


def _sliding_layers(config: Any) -> bool:
    return any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())


def packed_attention_inputs(config: Any, attention_sequence_ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The decoder's attention keywords for a packed row, from its host `attention_sequence_ids` ([1, S], -1 on the
    padding): `attention_mask` (the block mask, or None for flash-attention) and, for flash-attention, the
    boundaries (see the module docstring). A ValueError names an attention that cannot take them."""
    check_packing_attention(config)
    if not _varlen(config._attn_implementation):
        return {"attention_mask": packed_causal_mask(attention_sequence_ids.to(device, non_blocking=True))}
    if attention_sequence_ids.device.type != "cpu" or attention_sequence_ids.shape[0] != 1:
        raise ValueError(
            f"flash-attention over packed rows takes one row's host attention_sequence_ids; got shape "
            f"{list(attention_sequence_ids.shape)} on {attention_sequence_ids.device}"
        )
    lengths = torch.unique_consecutive(attention_sequence_ids[0], return_counts=True)[1]
    bounds = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32).to(device, non_blocking=True)
    longest = int(lengths.max())
    return {
        "attention_mask": None,
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def route_attention(config: Any) -> None:
    """Run the decoder's attention through `ulysses_attention_forward` (with no sp group: plain SDPA or the varlen
    kernel), for any decoder whose every layer is full attention or whose kernel applies windows itself. The name is
    not one of transformers' mask functions, so its mask code returns what it is given (None, or a packed row's
    mask) without computing a mask or reading the position ids (`find_packed_sequence_indices`, a host sync per
    forward on an accelerator), whatever the architecture. SDPA with sliding-window layers keeps transformers' own
    attention and mask (which apply the window). Idempotent."""
    name = config._attn_implementation
    if name == "sdpa" and not _sliding_layers(config):
        config._attn_implementation = register_ulysses_attention()
    elif name in VARLEN_ATTENTION:
        config._attn_implementation = register_ulysses_attention(name)


def decoder_attention_inputs(
    config: Any, attention_sequence_ids: torch.Tensor | None, device: torch.device
) -> dict[str, Any]:
    """The decoder's attention keywords: a packed row's (`packed_attention_inputs`) or, given None, causal attention's
    (no mask). The decoder's attention is routed first (`route_attention`), so transformers computes no mask."""
    route_attention(config)
    if attention_sequence_ids is None:
        return {"attention_mask": None}
    return packed_attention_inputs(config, attention_sequence_ids, device)


def register_ulysses_attention(inner: str = "sdpa") -> str:
    """Register Ulysses around `inner` and return its `attn_implementation` name (idempotent; needed before a config
    names it): `veomni_ulysses` around SDPA, `veomni_ulysses_<inner>` around a varlen kernel."""
    from transformers import AttentionInterface

    if inner == "sdpa":
        AttentionInterface.register(ATTENTION_NAME, ulysses_attention_forward)
        return ATTENTION_NAME
    name = f"{ATTENTION_NAME}_{inner}"
    AttentionInterface.register(name, functools.partial(ulysses_attention_forward, inner=inner))
    return name


def check_heads_divisible(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Raise ValueError naming the numbers when Ulysses cannot split the heads over `sp_size` ranks."""
    for what, value in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads)):
        if value % sp_size:
            raise ValueError(f"sequence parallel: {what} ({value}) is not divisible by sp_size ({sp_size})")


def enable_ulysses(text_config: Any, attention_modules: Iterable[nn.Module], sp_group: dist.ProcessGroup) -> None:
    """Route the decoder's attention through Ulysses over `sp_group`, around its varlen kernel if it has one, else
    SDPA (see the module docstring)."""
    name = text_config._attn_implementation
    inner = name.removeprefix(f"{ATTENTION_NAME}_") if _varlen(name) else "sdpa"
    if inner == "sdpa" and _sliding_layers(text_config):
        raise ValueError("sequence parallel: veomni_ulysses runs full attention; this model has sliding-window layers")
    check_heads_divisible(
        text_config.num_attention_heads,
        getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads,
        dist.get_world_size(sp_group),
    )
    text_config._attn_implementation = register_ulysses_attention(inner)
    for module in attention_modules:
        setattr(module, _GROUP_ATTR, sp_group)
