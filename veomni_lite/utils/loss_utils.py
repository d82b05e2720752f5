"""Loss normalization: every optimizer step trains on the exact global token mean, for one small all-reduce.

Names and signatures follow VeOmni's `veomni.utils.loss_utils`, so VeOmni callers drop in unchanged:

- `count_loss_token(batches)`: `<name>_tokens` (valid entries of `<name>_labels`; `labels` -> `foundation_tokens`),
  summed over every micro-batch given; a micro-batch with `padding_flag=True` counts 0.
- `mean_global_loss(losses, micro_batch_token_len, micro_batches_token_len, global_micro_batches_token_len=None)`:
  each `<name>_loss` (this rank's mean over its local valid tokens in this micro-batch) becomes
  `L * n / T * W`, where n = local valid tokens of this micro-batch, T = valid tokens of the whole step on all
  ranks, W = dp x sp world size. Summed over micro-batches and averaged over W by FSDP, the gradient is that of
  (sum of per-token losses of the step) / T. A key with n == 0 contributes exactly 0, value and gradient.
  Token counts may be tensors or Python numbers, with the same math.
- `reduce_global_loss_token(micro_batches_token_len)`: VeOmni's explicit form of T, `{key: total over all ranks}`
  as Python floats, for the 4th argument of `mean_global_loss`. With a 4th argument, T is used as given and
  W = `get_parallel_state().fsdp_size` (the only attribute read; no process group needed).

Cost: without a 4th argument, T is computed once per step dict (the object `micro_batches_token_len`) by ONE
all-reduce over the dp x sp group of only the consumed loss keys, and memoized; later micro-batches of the step issue
no collective and nothing is read from a device. The memo serves only the same dict with the same count objects at
the same tensor versions (an in-place `+=`/`copy_` gets new denominators) and holds one step. `reduce_global_loss_token`
reduces exactly the keys given (ONE all-reduce once agreed) and reads the result to the host once: VeOmni's contract
is numbers out.

Per micro-batch, two paths with bit-identical values and gradients:
- host numbers, where the labels were counted from host memory (`token_counts`: the trainer counts its CPU
  micro-batches) and the reduced buffer lies in host memory (gloo, or one rank): n and W / max(T, 1) are Python
  numbers, so each loss costs ONE multiply, by a 0-d factor made once per count in the step (a zero count: an
  exact-zero `where`); no count is redone per micro-batch. The step's later micro-batches with loss keys already
  validated skip re-validation (`_scale_in_host_numbers`).
- tensors otherwise (an NCCL reduce, counts on a device, counts the caller made): `where(n > 0, L, 0) * (n * scale)`
  on the loss device, four small ops per loss and no device sync.

Rank agreement (ranks that pack different key sets would reduce different buffers: garbage on gloo, a hang on NCCL):
- The agreement buffer: `MAX_LOSS_KEYS` = 8 count slots, then [1, f_a, f_a^2, f_b, f_b^2], two 16-bit fingerprints of
  the rank's sorted key names and a 1 per rank (13 int64, whatever the keys). After the SUM every rank knows whether
  W * sum(f^2) == sum(f)^2, true iff every rank sent the same f (Cauchy-Schwarz): the same verdict on every rank.
  A match makes the key set the agreed one (per caller and process group); a mismatch forgets it and raises
  `LossKeyMismatchError` on every rank, naming each rank's keys.
- Once agreed (steady state): the lean buffer, the k counts of the agreed keys in sorted order (k int64), and W is the
  agreement's (the group size; no collective). A rank whose own keys differ from the agreed ones, which it sees
  locally, sends -(2**62 // W) in each of the k slots instead: any sum holding such a slot is negative (exact in
  int64 while a key's step total is below 2**62 / W; valid totals are >= 0), so every rank reads the same
  "re-agree" from the same sum and sends the agreement buffer, which succeeds silently if every rank changed alike
  and raises on every rank if not. The first step, a new process group and a key-set change cost the agreement
  buffer; steady state costs k elements.
- Who reads the verdict: `reduce_global_loss_token` (its result goes to the host anyway) and `mean_global_loss` on
  CPU (the sum is in host memory: no device sync) read it at once. `mean_global_loss` on an accelerator cannot read
  it without a device sync, so it sends the agreement buffer every step (one small kernel whatever its size): the
  step's denominators are NaN until `verify_loss_keys()` reads the verdict at the step's existing host read (the
  trainer calls it with its grad-norm read). With one rank there is nothing to agree: the k counts, no verdict.
- The agreement changes only on a verdict that every rank reads from the same sum, so it is the same on every rank;
  `reset_loss_memo()` keeps it (a local call cannot desynchronize ranks); `forget_loss_agreements()`, called by every
  rank at the same point (the trainer does at construction), makes the next step agree afresh.
"""

from __future__ import annotations

import ctypes
import weakref
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

import torch
import torch.distributed as dist

from veomni_lite.distributed.collectives import all_gather_objects, all_reduce, collective_device, group_size
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.loss_keys import IGNORE_INDEX, labels_key, loss_key, name_of_loss, tokens_key
from veomni_lite.utils.token_counts import CountedStep, count_loss_token, counted_step, forget_counted_step

MAX_LOSS_KEYS = 8
_FINGERPRINT_BITS = 16  # f < 2**16: W * sum(f^2) and sum(f)^2 stay exact in int64 up to 2**15 ranks
_POISON_BUDGET = 2**62

TokenCount = torch.Tensor | int | float

__all__ = [
    "IGNORE_INDEX",
    "MAX_LOSS_KEYS",
    "LossKeyMismatchError",
    "count_loss_token",
    "mean_global_loss",
    "reduce_global_loss_token",
    "forget_loss_agreements",
    "reset_loss_memo",
    "verify_loss_keys",
]


class LossKeyMismatchError(RuntimeError):
    """Ranks consumed different loss keys in the same step."""


def _fingerprints(names: tuple[str, ...]) -> tuple[int, int]:
    text = "\x1f".join(names).encode()
    mask = (1 << _FINGERPRINT_BITS) - 1
    return zlib.crc32(text) & mask, zlib.adler32(text) & mask


def _as_count(value: TokenCount, key: str, which: str, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        # A non-blocking copy to the CPU could be read before it lands; copies to an accelerator are stream-ordered.
        return value.to(device, non_blocking=device.type != "cpu")
    # torch.full fills on the device from a kernel argument: no host-to-device copy, so no sync.
    if isinstance(value, Integral):
        return torch.full((), int(value), dtype=torch.int64, device=device)
    if isinstance(value, Real):
        return torch.full((), float(value), dtype=torch.float64, device=device)
    raise TypeError(f"{which}[{key!r}] is a {type(value).__name__}; expected a tensor or a number")


def _token_key_in(token_len: Mapping[str, TokenCount], name: str, which: str) -> str:
    """`<name>_tokens`, which `token_len` must hold (a KeyError names it otherwise)."""
    key = tokens_key(name)
    if key not in token_len:
        raise KeyError(
            f"mean_global_loss: {which} has no {key!r} for loss {loss_key(name)!r} (has {sorted(token_len)}); "
            f"the batch needs a {labels_key(name)!r} key"
        )
    return key


def _token_count(token_len: Mapping[str, TokenCount], name: str, which: str, device: torch.device) -> torch.Tensor:
    """The count of loss `name` in `token_len` as a tensor on `device`."""
    key = _token_key_in(token_len, name, which)
    return _as_count(token_len[key], key, f"mean_global_loss: {which}", device)


# ---------------------------------------------------------------- the agreement buffer (key sets not yet agreed)

_TRAILERS: dict[tuple[tuple[str, ...], torch.device], torch.Tensor] = {}


def _trailer(names: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """[1, f_a, f_a^2, f_b, f_b^2] on `device`, built once per key set so repeated agreements copy nothing."""
    key = (names, device)
    if key not in _TRAILERS:
        fp_a, fp_b = _fingerprints(names)
        _TRAILERS[key] = torch.tensor([1, fp_a, fp_a * fp_a, fp_b, fp_b * fp_b], dtype=torch.int64, device=device)
    return _TRAILERS[key]


def _all_reduce_packed(names: tuple[str, ...], local: torch.Tensor, device: torch.device) -> torch.Tensor:
    """ONE SUM all-reduce over the dp x sp group of `local` (int64, one count per name) in the agreement buffer.

    The buffer has the same size on every rank whatever its keys: `MAX_LOSS_KEYS` count slots, then the trailer.
    More names than slots pack no counts (the caller raises after the verdict, so every rank raises together).
    """
    slots = local if len(names) <= MAX_LOSS_KEYS else local[:0]
    padding = torch.zeros(MAX_LOSS_KEYS - slots.numel(), dtype=torch.int64, device=device)
    packed = torch.cat([slots, padding, _trailer(names, device)])
    return all_reduce(packed, op="sum", group=get_parallel_state().world_group)


def _read_packed(reduced: torch.Tensor, num_names: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(totals of the first `num_names` slots, world size W, keys_match) of a reduced agreement buffer; device ops."""
    trail = reduced[MAX_LOSS_KEYS:]
    world = trail[0]
    keys_match = (world * trail[2] == trail[1] * trail[1]) & (world * trail[4] == trail[3] * trail[3])
    return reduced[: min(num_names, MAX_LOSS_KEYS)], world, keys_match


# ---------------------------------------------------------------- the lean buffer (after an agreement)


@dataclass
class _Agreement:
    """A key set every rank of `group` sent through the agreement buffer with a matching verdict."""

    group: Callable[[], Any]  # weak reference: a new group (even at a reused id) re-agrees; a destroyed one is freed
    names: tuple[str, ...]
    world: torch.Tensor  # W from the agreement's 1-per-rank slot, float64 (the group size)


# One agreement per caller ("mean_global_loss", "reduce_global_loss_token"): they reduce different key sets. It
# changes only on a verdict every rank reads from the same reduced buffer, so it is the same on every rank.
_AGREEMENTS: dict[str, _Agreement] = {}

_LOSS_KEYS_HINT = (
    "Every rank must return the same loss keys on every micro-batch; return a zero that keeps the graph for a head "
    "with no targets."
)
_TOKEN_KEYS_HINT = (
    "Every rank's micro-batches must carry the same `<name>_labels` keys (all IGNORE_INDEX when a rank has no "
    "targets for a head)."
)
_HINTS = {"mean_global_loss": _LOSS_KEYS_HINT, "reduce_global_loss_token": _TOKEN_KEYS_HINT}


def forget_loss_agreements() -> None:
    """Drop every agreed key set, so the next step agrees afresh (one agreement all-reduce instead of a lean one).

    Collective in effect: every rank of a group must call it at the same point or none, e.g. when a new training run
    starts in the same processes (the trainer does it at construction).
    """
    _AGREEMENTS.clear()


def _world_key(group: dist.ProcessGroup | None) -> Any:
    """The process group a collective on `group` runs on (None resolves to the default group)."""
    if group is not None or not (dist.is_available() and dist.is_initialized()):
        return group
    return dist.group.WORLD


def _weak(group: Any) -> Callable[[], Any]:
    return (lambda: None) if group is None else weakref.ref(group)


def _stacked(counts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not counts:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.cat([count.reshape(1) for count in counts]).to(torch.int64)


def _poison(world_size: int) -> int:
    """What a rank whose keys left the agreed set sends per slot, exact in int64.

    Any sum of 1..W poisons is >= -2**62 (no overflow) and stays negative while every key's valid total is below
    2**62 / W, which no step reaches; valid counts are >= 0, so a negative sum can only mean a poisoned slot.
    """
    return -(_POISON_BUDGET // world_size)


def _too_many_keys(caller: str, names: tuple[str, ...]) -> ValueError:
    return ValueError(f"{caller}: {len(names)} keys {list(names)} exceed MAX_LOSS_KEYS={MAX_LOSS_KEYS}")


def _verdict_on_host(device: torch.device) -> bool:
    """Whether `mean_global_loss` reads rank-agreement verdicts at once: the buffer is in host memory (a read is no
    device sync) or there is one rank (no verdict to read)."""
    return device.type == "cpu" or group_size(get_parallel_state().world_group) == 1


@dataclass
class _Reduced:
    """The step totals of an agreed reduce."""

    totals: torch.Tensor  # int64, one per name
    world: torch.Tensor  # W, float64
    world_size: int  # W
    host_totals: list[int] | None  # the totals as ints where they were read from host memory (else None)


def _host_ints(reduced: torch.Tensor) -> list[int] | None:
    """`reduced` as ints where it lies in host memory (no device involved); else None."""
    return reduced.numpy().tolist() if reduced.device.type == "cpu" else None


def _reduce_agreed(caller: str, names: tuple[str, ...], local: torch.Tensor, device: torch.device) -> _Reduced:
    """The totals of `local` (int64, one count per name) over the dp x sp group, verdicts read on the host.

    Agreed key set: ONE all-reduce of len(names) int64. A rank whose names differ from the agreed ones sends
    `_poison` in every slot instead, so the sum is negative on EVERY rank; every rank then re-agrees through the
    agreement buffer (one more all-reduce) and raises `LossKeyMismatchError` together if the sets really differ. No
    agreement yet (first call, new group, last verdict a mismatch): the agreement buffer. The verdict reads are
    host reads: the callers use this path where the reduced buffer is in host memory or is read anyway.
    """
    group = get_parallel_state().world_group
    size = group_size(group)
    if size == 1:  # nobody to disagree with; the key limit still holds, as it does for W > 1
        if len(names) > MAX_LOSS_KEYS:
            raise _too_many_keys(caller, names)
        world = torch.ones((), dtype=torch.float64, device=device)  # filled there: a host-to-device copy would sync
        reduced = all_reduce(local, op="sum", group=group)
        return _Reduced(reduced, world, 1, _host_ints(reduced))
    world_key = _world_key(group)
    agreed = _AGREEMENTS.get(caller)
    if agreed is not None and agreed.group() is world_key:
        lean = local
        if names != agreed.names:  # this rank cannot send its counts in a buffer of the agreed size: it poisons the sum
            lean = torch.full((len(agreed.names),), _poison(size), dtype=torch.int64, device=device)
        reduced = all_reduce(lean, op="sum", group=group)
        host_totals = reduced.cpu().numpy().tolist()
        if min(host_totals) >= 0:
            return _Reduced(reduced, agreed.world, size, host_totals)
    _AGREEMENTS.pop(caller, None)
    totals, world, keys_match = _read_packed(_all_reduce_packed(names, local, device), len(names))
    if not keys_match.cpu().numpy():
        raise _key_mismatch_error({names}, _HINTS[caller])
    if len(names) > MAX_LOSS_KEYS:  # the verdict passed, so every rank has these keys and raises here
        raise _too_many_keys(caller, names)
    world = world.double()
    if names:  # an empty lean buffer could not carry a poisoned sum
        _AGREEMENTS[caller] = _Agreement(group=_weak(world_key), names=names, world=world)
    return _Reduced(totals, world, size, totals.cpu().numpy().tolist())


# ---------------------------------------------------------------- the memoized step denominators


def _tensor_version(value: TokenCount) -> int | None:
    # Inference tensors keep no version counter (and cannot be edited in place outside inference mode).
    return value._version if isinstance(value, torch.Tensor) and not value.is_inference() else None


def _tensor_versions(values: Sequence[TokenCount]) -> tuple[int | None, ...]:
    return tuple(_tensor_version(value) for value in values)


@dataclass
class _StepDenominators:
    """W / max(T, 1) per loss key for one step dict, and the device rank-agreement verdict where one is pending."""

    token_len: Mapping[str, TokenCount]  # strong reference: identity cannot be reused while memoized
    token_values: tuple[TokenCount, ...]  # the dict's values at reduce time: replacing one invalidates
    token_versions: tuple[int | None, ...]  # their version counters: an in-place edit invalidates (no host read)
    names: tuple[str, ...]
    device: torch.device
    device_scales: torch.Tensor | None  # W / max(T, 1) per name, float64 (NaN on a device-side key mismatch)
    keys_match: torch.Tensor | None  # None: checked on the host already
    host_scales: dict[str, float] | None = None  # W / max(T, 1) per name where T was read from host memory
    by_dtype: dict[torch.dtype, dict[str, torch.Tensor]] = field(default_factory=dict)
    host_factors: dict[tuple[str, int, torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict)

    def host_factor(self, name: str, count: int, loss: torch.Tensor) -> torch.Tensor:
        """n * W / max(T, 1) for a count known on the host, as a 0-d tensor of the loss dtype (a tensor multiplies
        faster than a Python number, backward included), built once per count and dtype in the step.

        Rounded as the tensor path rounds `n * scale` in the loss dtype (float32: n and the scale each rounded, then
        their product), so `loss * factor` is bit-identical to it.
        """
        key = (name, count, loss.dtype, loss.device)
        factor = self.host_factors.get(key)
        if factor is None:
            assert self.host_scales is not None
            scale = self.host_scales[name]
            if loss.dtype == torch.float32:
                exact_count = count if count < 2**24 else _float32(count)  # every int below 2**24 is a float32
                value = _float32(exact_count * _float32(scale))
            else:
                value = float(count) * scale
            factor = self.host_factors[key] = torch.scalar_tensor(value, dtype=loss.dtype, device=loss.device)
        return factor

    @property
    def scales(self) -> torch.Tensor:
        """W / max(T, 1) per name as a float64 tensor on the loss device (built from the host scales if need be)."""
        if self.device_scales is None:
            assert self.host_scales is not None
            values = [self.host_scales[name] for name in self.names]
            self.device_scales = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.device_scales

    def scales_in(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The scales cast once per step to the loss's compute dtype, so each micro-batch skips that cast."""
        if dtype not in self.by_dtype:
            self.by_dtype[dtype] = dict(zip(self.names, self.scales.to(dtype).unbind()))
        return self.by_dtype[dtype]

    def serves(self, token_len: Mapping[str, TokenCount]) -> bool:
        if self.token_len is not token_len:
            return False
        if len(token_len) != len(self.token_values):
            return False
        for value, kept, version in zip(token_len.values(), self.token_values, self.token_versions):
            if value is not kept or _tensor_version(value) != version:
                return False
        return True


@dataclass
class _PendingKeyCheck:
    """Verdicts not yet read on the host (accelerators only), AND-ed across steps until `verify_loss_keys`."""

    keys_match: torch.Tensor
    key_sets: set[tuple[str, ...]] = field(default_factory=set)


_MEMO: _StepDenominators | None = None
_PENDING: _PendingKeyCheck | None = None


def reset_loss_memo() -> None:
    """Drop the memoized step denominators, the kept step counts and any pending key check (local: the agreed key
    sets are kept)."""
    global _MEMO, _PENDING
    _MEMO = None
    _PENDING = None
    forget_counted_step()


def _reduce_step_denominators(
    names: tuple[str, ...], token_len: Mapping[str, TokenCount], device: torch.device
) -> _StepDenominators:
    values = tuple(token_len.values())
    memo = _StepDenominators(
        token_len=token_len,
        token_values=values,
        token_versions=_tensor_versions(values),
        names=names,
        device=device,
        device_scales=None,
        keys_match=None,
    )
    if _verdict_on_host(device):
        counted = counted_step()
        which = "micro_batches_token_len"
        if device.type == "cpu" and counted is not None and counted.describes(token_len):
            # The counts are ints already: the buffer is built from them, with no op per count.
            local = torch.tensor([counted.totals[_token_key_in(token_len, name, which)] for name in names])
        else:
            local = _stacked([_token_count(token_len, name, which, device) for name in names], device)
        reduced = _reduce_agreed("mean_global_loss", names, local, device)
        if reduced.host_totals is not None:  # scale in host numbers: one multiply per loss and micro-batch
            size = reduced.world_size
            memo.host_scales = {name: size / max(total, 1) for name, total in zip(names, reduced.host_totals)}
        else:
            memo.device_scales = reduced.world.to(device) / reduced.totals.clamp(min=1).double()
        return memo
    # Reading a verdict here would be a device sync, so every step sends the self-checking agreement buffer
    # (one small kernel whatever its size) and the verdict is read at the step's existing host read.
    # The model's loss keys are the same on every rank by contract, so this raises on all ranks together.
    if len(names) > MAX_LOSS_KEYS:
        raise _too_many_keys("mean_global_loss", names)
    local = _stacked([_token_count(token_len, name, "micro_batches_token_len", device) for name in names], device)
    totals, world, keys_match = _read_packed(_all_reduce_packed(names, local, device), len(names))
    scales = world.double().to(device) / totals.clamp(min=1).double()
    memo.device_scales = torch.where(keys_match, scales, torch.full_like(scales, float("nan")))  # no usable value
    memo.keys_match = keys_match  # leaves here before the verdict is read
    return memo


def _step_denominators(
    names: tuple[str, ...], token_len: Mapping[str, TokenCount], device: torch.device
) -> _StepDenominators:
    global _MEMO, _PENDING
    memo = _MEMO
    if memo is not None and memo.serves(token_len):
        missing = [] if names == memo.names else [name for name in names if name not in memo.names]
        if missing:
            raise ValueError(
                f"mean_global_loss: loss keys {missing} appeared mid-step (the step started with {list(memo.names)}); "
                "every micro-batch of a step must return the same loss keys"
            )
        return memo
    memo = _reduce_step_denominators(names, token_len, device)
    _MEMO = memo
    if memo.keys_match is not None:
        if _PENDING is None:
            _PENDING = _PendingKeyCheck(memo.keys_match, {names})
        else:
            _PENDING.keys_match = _PENDING.keys_match & memo.keys_match
            _PENDING.key_sets.add(names)
    return memo


def _key_mismatch_error(local_key_sets: set[tuple[str, ...]], hint: str = _LOSS_KEYS_HINT) -> LossKeyMismatchError:
    """Every rank reaches this together (the verdict is global), so gathering the key sets cannot hang."""
    mine = sorted(list(keys) for keys in local_key_sets)
    gathered = all_gather_objects(mine, get_parallel_state().world_group)
    detail = "; ".join(f"rank {rank}: {keys}" for rank, keys in enumerate(gathered))
    rank = dist.get_rank() if len(gathered) > 1 else 0
    return LossKeyMismatchError(f"loss keys differ across ranks (seen on rank {rank}): {detail}. {hint}")


def verify_loss_keys() -> None:
    """Read any pending rank-agreement verdict (one host read) and raise `LossKeyMismatchError` on every rank.

    Call it where the step reads a value to the host anyway; on CPU `mean_global_loss` has already checked.
    Every rank must call it at the same point of the step.
    """
    global _PENDING
    pending, _PENDING = _PENDING, None
    if pending is not None and not pending.keys_match.cpu().numpy():
        raise _key_mismatch_error(pending.key_sets)


_LOSS_NAMES: dict[str, str] = {}  # `<name>_loss` -> `<name>`, parsed once per key


def _as_loss_items(losses: torch.Tensor | Mapping[str, torch.Tensor]) -> list[tuple[str, str, torch.Tensor]]:
    """(loss key, name, loss) per entry of `losses`, validated."""
    if isinstance(losses, torch.Tensor):
        return [("foundation_loss", "foundation", losses)]
    if not isinstance(losses, Mapping) or not losses:
        raise TypeError(
            f"mean_global_loss: losses is a {type(losses).__name__}; expected a tensor or a non-empty "
            "{'<name>_loss': tensor} dict"
        )
    items = []
    for key, value in losses.items():
        name = _LOSS_NAMES.get(key) if isinstance(key, str) else None
        if name is None:
            try:
                name = _LOSS_NAMES[key] = name_of_loss(key)
            except KeyError as exc:
                raise KeyError(f"mean_global_loss: {exc.args[0]}") from None
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"mean_global_loss: {key!r} is a {type(value).__name__}; expected a tensor")
        items.append((key, name, value))
    return items


_CONSTANTS: dict[tuple[bool | int, torch.dtype, torch.device], torch.Tensor] = {}


def _constant(value: bool | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d constant, built once per value, dtype and device (`torch.where` is cheaper with it than with a Python
    number)."""
    key = (value, dtype, device)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.full((), value, dtype=dtype, device=device)
    return _CONSTANTS[key]


_HOST_SCALED_DTYPES = (torch.float32, torch.float64)  # dtypes the generic path would not promote


def _host_count(token_len: Mapping[str, TokenCount], name: str, counted: CountedStep | None) -> int | None:
    """This micro-batch's count of `name` as an int where it is known without a read (a count `counted` handed out,
    or an int); else None."""
    value = token_len[_token_key_in(token_len, name, "micro_batch_token_len")]
    if isinstance(value, torch.Tensor):
        return counted.host_count(value) if counted is not None else None
    return value if type(value) is int else None


def _float32(value: float) -> float:
    """`value` rounded to the nearest float32."""
    return ctypes.c_float(value).value


def _exact_zero(loss: torch.Tensor) -> torch.Tensor:
    """0 in the loss dtype that keeps the graph, with an exact zero gradient whatever the loss (NaN included)."""
    return torch.where(_constant(False, torch.bool, loss.device), loss, _constant(0, loss.dtype, loss.device))


def _fsdp_size() -> int:
    """W for an explicit 4th argument: VeOmni's `fsdp_size`, the only attribute this path reads."""
    size = get_parallel_state().fsdp_size
    # A process group without a parallel state (plain torch.distributed): FSDP averages over the whole world.
    return size if size != 1 else group_size()


# The loss keys of a dict as given -> ((loss key, name, token key) per loss, sorted names): validated by the full path.
_LOSS_PLANS: dict[tuple[Any, ...], tuple[tuple[tuple[str, str, str], ...], tuple[str, ...]]] = {}


def _scale_in_host_numbers(
    memo: _StepDenominators,
    losses: Any,
    micro_batch_token_len: Any,
    micro_batches_token_len: Mapping[str, TokenCount],
) -> dict[str, torch.Tensor] | None:
    """The common micro-batch of a host-scaled step, in its fewest steps: the same loss keys as validated before, the
    step dict the memo serves, counts this step handed out, float32/float64 losses. Bit-identical to the full path;
    None (the full path then decides, errors included) on anything else."""
    if type(losses) is not dict or type(micro_batch_token_len) is not dict:
        return None
    plan = _LOSS_PLANS.get(tuple(losses))
    if plan is None or plan[1] != memo.names or not memo.serves(micro_batches_token_len):
        return None
    counted = counted_step()
    if counted is None:
        return None
    scaled = {}
    for key, name, token_key in plan[0]:
        loss = losses[key]
        count = counted.host_count(micro_batch_token_len.get(token_key))
        if count is None or type(loss) is not torch.Tensor or loss.dtype not in _HOST_SCALED_DTYPES:
            return None
        scaled[key] = loss * memo.host_factor(name, count, loss) if count > 0 else _exact_zero(loss)
    return scaled


def mean_global_loss(
    losses: torch.Tensor | Mapping[str, torch.Tensor],
    micro_batch_token_len: Mapping[str, TokenCount],
    micro_batches_token_len: Mapping[str, TokenCount],
    global_micro_batches_token_len: Mapping[str, TokenCount] | None = None,
) -> dict[str, torch.Tensor]:
    """Scale each local-mean loss so the step sums to the exact global token mean (see the module docstring).

    Without `global_micro_batches_token_len`, T comes from the memoized all-reduce of `micro_batches_token_len`;
    with it (tensors or numbers, e.g. from `reduce_global_loss_token`), T is used as given.
    """
    memo = _MEMO
    if global_micro_batches_token_len is None and memo is not None and memo.host_scales is not None:
        scaled = _scale_in_host_numbers(memo, losses, micro_batch_token_len, micro_batches_token_len)
        if scaled is not None:
            return scaled
    items = _as_loss_items(losses)
    device = items[0][2].device
    memo = None
    if global_micro_batches_token_len is None:
        memo = _step_denominators(tuple(sorted(name for _, name, _ in items)), micro_batches_token_len, device)
        if isinstance(losses, dict):
            _LOSS_PLANS[tuple(losses)] = (tuple((key, name, tokens_key(name)) for key, name, _ in items), memo.names)

    host_scales = memo.host_scales if memo is not None else None
    counted = counted_step()
    scaled: dict[str, torch.Tensor] = {}
    for key, name, loss in items:
        if host_scales is not None and loss.dtype in _HOST_SCALED_DTYPES:
            count = _host_count(micro_batch_token_len, name, counted)
            if count is not None:  # ONE multiply, bit-identical to the tensor path below
                scaled[key] = loss * memo.host_factor(name, count, loss) if count > 0 else _exact_zero(loss)
                continue
        dtype = torch.promote_types(loss.dtype, torch.float32)
        if memo is not None:
            scale = memo.scales_in(dtype)[name]
        else:
            total = _token_count(global_micro_batches_token_len, name, "global_micro_batches_token_len", device)
            scale = (_fsdp_size() / total.clamp(min=1).double()).to(dtype)
        local_tokens = _token_count(micro_batch_token_len, name, "micro_batch_token_len", device)
        # n * W / max(T, 1) is finite even when T == 0, so the masked branch passes an exact zero gradient to the loss.
        factor = local_tokens * scale
        if factor.dtype != dtype:  # counts given as floats
            factor = factor.to(dtype)
        scaled[key] = torch.where(local_tokens > 0, loss, _constant(0, dtype, device)) * factor
    return scaled


def reduce_global_loss_token(micro_batches_token_len: Mapping[str, TokenCount]) -> dict[str, float]:
    """Every key of the step's token counts summed over the dp x sp group, as Python floats (VeOmni's signature).

    Once the keys are agreed: ONE all-reduce of exactly the given keys' counts, then one host read (numbers out is
    VeOmni's contract); the first call and a key-set change cost the agreement buffer too. The sums are exact int64;
    as floats they stay exact below 2**53. Ranks whose key sets differ all raise `LossKeyMismatchError` naming each
    rank's keys. Pass the result as the 4th argument of `mean_global_loss`.
    """
    names = tuple(sorted(micro_batches_token_len))
    device = collective_device(get_parallel_state().world_group)
    counts = [
        _as_count(micro_batches_token_len[name], name, "reduce_global_loss_token: micro_batches_token_len", device)
        for name in names
    ]
    reduced = _reduce_agreed("reduce_global_loss_token", names, _stacked(counts, device), device)
    totals = reduced.host_totals if reduced.host_totals is not None else reduced.totals.cpu().tolist()
    by_name = dict(zip(names, totals))
    return {key: float(by_name[key]) for key in micro_batches_token_len}
