"""Loss normalization: every optimizer step trains on the exact global token mean, for one packed all-reduce.

Names and signatures follow VeOmni's `veomni.utils.loss_utils`:

- `count_loss_token(batches)`: `<name>_tokens` (valid entries of `<name>_labels`; `labels` -> `foundation_tokens`),
  summed over every micro-batch given; a micro-batch with `padding_flag=True` counts 0.
- `mean_global_loss(losses, micro_batch_token_len, micro_batches_token_len, global_micro_batches_token_len=None)`:
  each `<name>_loss` (this rank's mean over its local valid tokens in this micro-batch) becomes
  `L * n / T * W`, where n = local valid tokens of this micro-batch, T = valid tokens of the whole step on all
  ranks, W = dp x sp world size. Summed over micro-batches and averaged over W by FSDP, the gradient is that of
  (sum of per-token losses of the step) / T. A key with n == 0 contributes exactly 0, value and gradient.

Cost: T is computed once per step dict (the object `micro_batches_token_len`), by ONE all-reduce of a fixed-size
int64 buffer over the dp x sp group, and memoized; later micro-batches of the step issue no collective. No value
is read to the host in these functions.

Rank agreement: the buffer has a fixed size (`MAX_LOSS_KEYS` = 8 count slots) and carries two fingerprints of the rank's
sorted loss-key names, each as (f, f^2), plus a 1 per rank. After the SUM, all ranks agree on whether
W * sum(f^2) == sum(f)^2, which holds iff every rank sent the same f (Cauchy-Schwarz), so a key mismatch can never
make the collective itself hang or return garbage silently, and every rank reaches the same verdict. The verdict
is a device tensor: on CPU it is read at once (host memory, no device sync) and `mean_global_loss` raises
`LossKeyMismatchError` on every rank; on an accelerator the step's denominators become NaN and
`verify_loss_keys()` raises at the step's existing host read (the trainer calls it with its grad-norm read).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.utils.dist_utils import all_reduce

IGNORE_INDEX = -100
MAX_LOSS_KEYS = 8
_FINGERPRINT_BITS = 16  # f < 2**16: W * sum(f^2) and sum(f)^2 stay exact in int64 up to 2**15 ranks

__all__ = [
    "IGNORE_INDEX",
    "MAX_LOSS_KEYS",
    "LossKeyMismatchError",
    "count_loss_token",
    "mean_global_loss",
    "reset_loss_memo",
    "verify_loss_keys",
]


class LossKeyMismatchError(RuntimeError):
    """Ranks consumed different loss keys in the same step."""


def _iter_micro_batches(batches: Any, where: str = "batches") -> Iterator[Mapping[str, Any]]:
    if isinstance(batches, Mapping):
        yield batches
    elif isinstance(batches, (list, tuple)):
        for index, item in enumerate(batches):
            yield from _iter_micro_batches(item, f"{where}[{index}]")
    else:
        raise TypeError(
            f"count_loss_token: {where} is a {type(batches).__name__}; expected a dict micro-batch "
            "or a (nested) list/tuple of them"
        )


def _token_key(batch_key: str) -> str | None:
    if batch_key == "labels":
        return "foundation_tokens"
    if batch_key.endswith("_labels"):
        return batch_key[: -len("_labels")] + "_tokens"
    return None


def count_loss_token(batches: Any) -> dict[str, torch.Tensor]:
    """Valid-token counts per loss key, summed over all micro-batches given (int64 tensors, no host sync)."""
    counts: dict[str, torch.Tensor] = {}
    for batch in _iter_micro_batches(batches):
        padding_flag = batch.get("padding_flag", False)
        for batch_key, labels in batch.items():
            token_key = _token_key(batch_key)
            if token_key is None:
                continue
            if not isinstance(labels, torch.Tensor):
                raise TypeError(f"count_loss_token: {batch_key!r} is a {type(labels).__name__}; expected a tensor")
            count = (labels != IGNORE_INDEX).sum(dtype=torch.int64)
            if isinstance(padding_flag, torch.Tensor):
                count = torch.where(padding_flag.to(count.device).bool().any(), 0, count)
            elif padding_flag:
                count = torch.zeros_like(count)
            counts[token_key] = counts[token_key] + count.to(counts[token_key].device) if token_key in counts else count
    return counts


def _fingerprints(names: tuple[str, ...]) -> tuple[int, int]:
    text = "\x1f".join(names).encode()
    mask = (1 << _FINGERPRINT_BITS) - 1
    return zlib.crc32(text) & mask, zlib.adler32(text) & mask


@dataclass
class _StepDenominators:
    """T per loss key for one step dict, plus the world size W and the rank-agreement verdict."""

    token_len: Mapping[str, torch.Tensor]  # strong reference: identity cannot be reused while memoized
    token_tensors: tuple[torch.Tensor, ...]  # the dict's values at reduce time: in-place edits invalidate
    names: tuple[str, ...]
    scales: dict[str, torch.Tensor]  # W / max(T, 1) per key, float64 on the loss device (NaN on a key mismatch)
    keys_match: torch.Tensor

    def serves(self, token_len: Mapping[str, torch.Tensor]) -> bool:
        return (
            self.token_len is token_len
            and len(self.token_tensors) == len(token_len)
            and all(a is b for a, b in zip(self.token_tensors, token_len.values()))
        )


@dataclass
class _PendingKeyCheck:
    """Verdicts not yet read on the host (accelerators only), AND-ed across steps until `verify_loss_keys`."""

    keys_match: torch.Tensor
    key_sets: set[tuple[str, ...]] = field(default_factory=set)


_MEMO: _StepDenominators | None = None
_PENDING: _PendingKeyCheck | None = None


def reset_loss_memo() -> None:
    """Drop the memoized step denominators and any pending key check."""
    global _MEMO, _PENDING
    _MEMO = None
    _PENDING = None


def _token_count(token_len: Mapping[str, torch.Tensor], name: str, which: str) -> torch.Tensor:
    key = f"{name}_tokens"
    if key not in token_len:
        raise KeyError(
            f"mean_global_loss: {which} has no {key!r} for loss {name + '_loss'!r} (has {sorted(token_len)}); "
            f"the batch needs a {'labels' if name == 'foundation' else name + '_labels'!r} key"
        )
    return token_len[key]


_TRAILERS: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}


def _trailer(names: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """[1, f_a, f_a^2, f_b, f_b^2] on `device`, built once per key set so steady-state steps copy nothing."""
    key = (names, device)
    if key not in _TRAILERS:
        fp_a, fp_b = _fingerprints(names)
        _TRAILERS[key] = torch.tensor([1, fp_a, fp_a * fp_a, fp_b, fp_b * fp_b], dtype=torch.int64, device=device)
    return _TRAILERS[key]


def _reduce_step_denominators(
    names: tuple[str, ...], token_len: Mapping[str, torch.Tensor], device: torch.device
) -> _StepDenominators:
    if len(names) > MAX_LOSS_KEYS:
        raise ValueError(f"mean_global_loss: {len(names)} loss keys {list(names)} exceed MAX_LOSS_KEYS={MAX_LOSS_KEYS}")
    counts = [
        _token_count(token_len, name, "micro_batches_token_len").to(device, torch.int64, non_blocking=True).reshape(1)
        for name in names
    ]
    padding = torch.zeros(MAX_LOSS_KEYS - len(names), dtype=torch.int64, device=device)
    local = torch.cat([*counts, padding, _trailer(names, device)])
    reduced = all_reduce(local, op="sum", group=get_parallel_state().world_group)
    trail = reduced[MAX_LOSS_KEYS:]
    world = trail[0]
    keys_match = (world * trail[2] == trail[1] * trail[1]) & (world * trail[4] == trail[3] * trail[3])
    scales = world.double() / reduced[: len(names)].clamp(min=1).double()
    if device.type != "cpu":  # the verdict is read later (verify_loss_keys): meanwhile no usable value leaves here
        scales = torch.where(keys_match, scales, torch.full_like(scales, float("nan")))
    return _StepDenominators(
        token_len=token_len,
        token_tensors=tuple(token_len.values()),
        names=names,
        scales=dict(zip(names, scales.unbind())),
        keys_match=keys_match,
    )


def _step_denominators(
    names: tuple[str, ...], token_len: Mapping[str, torch.Tensor], device: torch.device
) -> _StepDenominators:
    global _MEMO, _PENDING
    memo = _MEMO
    if memo is not None and memo.serves(token_len):
        missing = [name for name in names if name not in memo.names]
        if missing:
            raise ValueError(
                f"mean_global_loss: loss keys {missing} appeared mid-step (the step started with {list(memo.names)}); "
                "every micro-batch of a step must return the same loss keys"
            )
        return memo
    memo = _reduce_step_denominators(names, token_len, device)
    _MEMO = memo
    if device.type == "cpu":
        # Host memory: reading the verdict is not a device sync, so raise before any value is returned.
        if not memo.keys_match.numpy():
            raise _key_mismatch_error({names})
    elif _PENDING is None:
        _PENDING = _PendingKeyCheck(memo.keys_match, {names})
    else:
        _PENDING.keys_match = _PENDING.keys_match & memo.keys_match
        _PENDING.key_sets.add(names)
    return memo


def _key_mismatch_error(local_key_sets: set[tuple[str, ...]]) -> LossKeyMismatchError:
    """Every rank reaches this together (the verdict is global), so gathering the key sets cannot hang."""
    mine = sorted(list(keys) for keys in local_key_sets)
    state = get_parallel_state()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=state.world_group)
        detail = "; ".join(f"rank {rank}: {keys}" for rank, keys in enumerate(gathered))
        rank = dist.get_rank()
    else:
        detail, rank = f"rank 0: {mine}", 0
    return LossKeyMismatchError(
        f"loss keys differ across ranks (seen on rank {rank}): {detail}. Every rank must return the same loss keys "
        "on every micro-batch; return a zero that keeps the graph for a head with no targets."
    )


def verify_loss_keys() -> None:
    """Read any pending rank-agreement verdict (one host read) and raise `LossKeyMismatchError` on every rank.

    Call it where the step reads a value to the host anyway; on CPU `mean_global_loss` has already checked.
    Every rank must call it at the same point of the step.
    """
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is not None and not pending.keys_match.cpu().numpy():
        raise _key_mismatch_error(pending.key_sets)


def _as_loss_dict(losses: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(losses, torch.Tensor):
        return {"foundation_loss": losses}
    if not isinstance(losses, Mapping) or not losses:
        raise TypeError(
            f"mean_global_loss: losses is a {type(losses).__name__}; expected a tensor or a non-empty "
            "{'<name>_loss': tensor} dict"
        )
    for key, value in losses.items():
        if not isinstance(key, str) or not key.endswith("_loss"):
            raise KeyError(f"mean_global_loss: loss key {key!r} must be named '<name>_loss'")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"mean_global_loss: {key!r} is a {type(value).__name__}; expected a tensor")
    return dict(losses)


def mean_global_loss(
    losses: torch.Tensor | Mapping[str, torch.Tensor],
    micro_batch_token_len: Mapping[str, torch.Tensor],
    micro_batches_token_len: Mapping[str, torch.Tensor],
    global_micro_batches_token_len: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Scale each local-mean loss so the step sums to the exact global token mean (see the module docstring)."""
    loss_dict = _as_loss_dict(losses)
    names = tuple(sorted(key[: -len("_loss")] for key in loss_dict))
    device = next(iter(loss_dict.values())).device

    if global_micro_batches_token_len is None:
        scales = _step_denominators(names, micro_batches_token_len, device).scales
    else:
        world = get_parallel_state().world_size
        if world == 1 and dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
        scales = {
            name: world
            / _token_count(global_micro_batches_token_len, name, "global_micro_batches_token_len")
            .to(device, non_blocking=True)
            .clamp(min=1)
            .double()
            for name in names
        }

    scaled: dict[str, torch.Tensor] = {}
    for key, loss in loss_dict.items():
        name = key[: -len("_loss")]
        local_tokens = _token_count(micro_batch_token_len, name, "micro_batch_token_len").to(device, non_blocking=True)
        # n * W / max(T, 1) is finite even when T == 0, so the masked branch passes an exact zero gradient to the loss.
        factor = (local_tokens * scales[name]).to(torch.promote_types(loss.dtype, torch.float32))
        scaled[key] = torch.where(local_tokens > 0, loss, torch.zeros_like(loss)) * factor
    return scaled
