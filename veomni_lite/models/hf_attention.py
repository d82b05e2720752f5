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
wrote; models list it in `host_inputs`) into what the attention takes, computed on the host, with no position or mask
read back from the device and no [S, S] mask. For SDPA and `veomni_ulysses`: `packed_segments`, the row's samples (the
padding after them is a sample of its own) grouped by shape as index tensors, for `veomni_ulysses` (every decoder runs
it, see `route_attention`), which runs `segment_attention`: each group's samples gathered into one batch, causal SDPA on
it (`enable_gqa`, no key/value heads expanded), the outputs put back in row order. A row costs the sum of its samples'
squares, not its own. A branch of a shared prefix (`veomni_lite.data.collator`) takes the prefix's keys and values
before its own, with an [Lq, Lk] mask (every prefix key, then causal). Under Ulysses this runs after the all-to-all,
where each rank sees the whole row. For flash-attention (`VARLEN_ATTENTION`, and Ulysses around it): no mask, and the
whole row's boundaries as `cu_seq_lens_q/k` (int32; the padding after the samples is a sequence of its own) with
`max_length_q/k` (ints), which transformers hands to the varlen kernel as they are (after the all-to-all under Ulysses).
`check_packing_attention` refuses other implementations (eager adds a mask of its own) and, outside flash-attention,
sliding-window layers (the per-sample attention is full). The models call `decoder_attention_inputs`, which first
routes the decoder's attention through `ulysses_attention_forward` (`route_attention`; without an sp group it is SDPA
per sample or the varlen kernel alone) for any architecture: the name has no mask function, so transformers' mask
code computes no mask and never reads the position ids (`find_packed_sequence_indices`, a host sync per forward on
an accelerator).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from veomni_lite.distributed.sequence_parallel import heads_to_seq, seq_to_heads
from veomni_lite.models.contract import on_host

ATTENTION_NAME = "veomni_ulysses"
_GROUP_ATTR = "veomni_sp_group"


@dataclass(frozen=True)
class PackedSegments:
    """Packed rows' samples as index tensors (on the attention's device), planned on the host: `groups` holds, per
    (query length Lq, key length Lk), the [m, Lq] flat query indices (row * S + position) of the m samples of that
    shape, their [m, Lk] key indices and the [Lq, Lk] boolean mask (both None: the queries themselves, causal); a
    branch of a shared prefix has the prefix's positions, then its own, as keys. `order` is the inverse permutation
    taking the groups' outputs, concatenated, back to row order."""

    groups: tuple[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None], ...]
    order: torch.Tensor


def packed_segments(attention_sequence_ids: torch.Tensor, device: torch.device) -> PackedSegments:
    """The `PackedSegments` of host `attention_sequence_ids` [B, S] (each run of one id is a sample; the padding, -1,
    is one too, so every position is in one; a run of an id <= -2 is a shared prefix, which the sample runs after it,
    up to the next prefix or the padding, attend to as well: `veomni_lite.data.collator`). A ValueError names a
    device tensor (reading it would sync)."""
    if attention_sequence_ids.device.type != "cpu" or attention_sequence_ids.dim() != 2:
        raise ValueError(
            f"packed attention takes the rows' host attention_sequence_ids [B, S]; got shape "
            f"{list(attention_sequence_ids.shape)} on {attention_sequence_ids.device}"
        )
    # (Lq, Lk) -> (the runs' starts, a branch's prefix (start, length) each); Lk == Lq: plain causal runs
    shapes: dict[tuple[int, int], tuple[list[int], list[tuple[int, int]]]] = defaultdict(lambda: ([], []))
    length = attention_sequence_ids.shape[1]
    for row, ids in enumerate(attention_sequence_ids):
        start, prefix = row * length, None
        values, counts = torch.unique_consecutive(ids, return_counts=True)
        for value, n in zip(values.tolist(), counts.tolist()):
            branch = value >= 0 and prefix is not None
            starts, prefixes = shapes[(n, n + prefix[1] if branch else n)]
            starts.append(start)
            if branch:
                prefixes.append(prefix)
            prefix = (start, n) if value <= -2 else prefix if value >= 0 else None
            start += n
    groups, flat = [], []
    for (n, k), (starts, prefixes) in sorted(shapes.items()):
        index = torch.tensor(starts)[:, None] + torch.arange(n)
        keys = mask = None
        if k != n:  # branches: every prefix key, then causal over their own
            before = torch.tensor([first for first, _ in prefixes])[:, None] + torch.arange(k - n)
            keys = torch.cat([before, index], dim=1).to(device, non_blocking=True)
            mask = torch.ones(n, k, dtype=torch.bool).tril(k - n).to(device, non_blocking=True)
        groups.append((index.to(device, non_blocking=True), keys, mask))
        flat.append(index.reshape(-1))
    positions = torch.cat(flat)
    order = torch.empty_like(positions)
    order[positions] = torch.arange(positions.numel())
    return PackedSegments(tuple(groups), order.to(device, non_blocking=True))


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: PackedSegments,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each sample of packed rows (a shared prefix's branch: over the prefix, then causal over
    itself): `query` [B, H, S, D], `key`/`value` [B, H_kv, S, D] -> [B, S, H, D]. One SDPA call per sample shape,
    over that shape's samples as a batch."""
    rows, heads, length, dim = query.shape
    flat = [t.transpose(1, 2).reshape(rows * length, t.shape[1], dim) for t in (query, key, value)]  # [B*S, h, D]
    outs = []
    for index, keys, mask in segments.groups:
        q = flat[0][index].transpose(1, 2)  # [m, h, Lq, D]
        k, v = (t[index if keys is None else keys].transpose(1, 2) for t in flat[1:])
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=mask is None, enable_gqa=True
        )
        outs.append(out.transpose(1, 2).reshape(-1, heads, dim))
    return torch.cat(outs)[segments.order].view(rows, length, heads, dim)


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    inner: str = "sdpa",
    packed_segments: PackedSegments | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; see the module docstring for the layouts. `attention_mask`: None
    (causal) or a [B, 1, S, S] mask over the whole sequence; `packed_segments`: the whole row's samples (SDPA per
    sample). `inner`: the attention run after the all-to-all, SDPA or a varlen kernel (`VARLEN_ATTENTION`), which
    takes the whole row's boundaries in `kwargs`."""
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
    dropout = dropout if module.training else 0.0
    if packed_segments is not None:
        out = segment_attention(q, k, v, packed_segments, scaling, dropout)
    else:
        causal = attention_mask is None
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=True
        ).transpose(1, 2)  # [B, S, H/sp, D]
    if group is not None:
        out = heads_to_seq(out.contiguous(), group)
    return out.contiguous(), None


VARLEN_ATTENTION = {"flash_attention_2", "flash_attention_3", "flash_attention_4"}  # take cu_seq_lens, no mask
PACKING_ATTENTION = ("sdpa", ATTENTION_NAME)


def check_packing_attention(config: Any) -> None:
    """Raise ValueError unless `config`'s attention keeps a packed row's samples apart (see the module docstring)."""
    name = getattr(config, "_attn_implementation", None)
    if name not in PACKING_ATTENTION and not takes_boundaries(name):
        choices = (*PACKING_ATTENTION, *sorted(VARLEN_ATTENTION))
        raise ValueError(
            f"data.packing: attention {name!r} cannot keep the packed rows' samples apart; use one of {choices}"
        )
    if not takes_boundaries(name) and _sliding_layers(config):
        raise ValueError(f"data.packing: sliding-window layers need flash-attention (attention {name!r} would drop it)")


def takes_boundaries(name: str | None) -> bool:
    """Whether attention `name` takes packed rows as flash-attention does (boundaries, no mask), alone or in Ulysses."""
    return name in VARLEN_ATTENTION or (name or "").removeprefix(f"{ATTENTION_NAME}_") in VARLEN_ATTENTION


def _sliding_layers(config: Any) -> bool:
    return any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())


def packed_attention_inputs(config: Any, attention_sequence_ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    """The decoder's attention keywords for packed rows, from their host `attention_sequence_ids` ([B, S], -1 on the
    padding; one row for flash-attention): `attention_mask` None and `packed_segments` for SDPA and Ulysses, the
    boundaries for flash-attention (see the module docstring). A ValueError names an attention that cannot take
    them."""
    check_packing_attention(config)
    if not takes_boundaries(config._attn_implementation):
        return {"attention_mask": None, "packed_segments": packed_segments(attention_sequence_ids, device)}
    if attention_sequence_ids.device.type != "cpu" or attention_sequence_ids.shape[0] != 1:
        raise ValueError(
            f"flash-attention over packed rows takes one row's host attention_sequence_ids; got shape "
            f"{list(attention_sequence_ids.shape)} on {attention_sequence_ids.device}"
        )
    if (attention_sequence_ids < -1).any():
        raise ValueError(
            "shared prefixes (data.shared_prefix) need SDPA attention; flash-attention takes each packed sample whole"
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
    attention_sequence_ids = on_host(attention_sequence_ids)  # the trainer's `HostInput`
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
    inner = name.removeprefix(f"{ATTENTION_NAME}_") if takes_boundaries(name) else "sdpa"
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
