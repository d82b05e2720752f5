"""Loss normalization: every optimizer step trains on the exact global value of each head's loss mode.

Names and signatures follow VeOmni's `veomni.utils.loss_utils`, so VeOmni callers drop in unchanged:
`count_loss_token(micro_batches)` once per step, then per micro-batch
`mean_global_loss(outputs, count_loss_token(micro_batch), micro_batches_token_len)`, backward, and FSDP's average.

Math. Each `<name>_loss` is this rank's mean over its n local valid targets of the micro-batch, of l_t * w_t
(w_t = `<name>_loss_weights` where the batch has it, else 1). `mean_global_loss` returns `L * n * W / D`, W = dp x sp,
and an exact 0 (value and gradient, never NaN) where n == 0. Summed over micro-batches, averaged over W by FSDP, the
gradient is that of sum_t w_t l_t / D over the step on all ranks, with D and w per mode (`LOSS_MODES`):
  token-mean               D = T (valid targets of the step)     w = 1
  seq-mean-token-mean      D = N (sequences with a target)       w = 1 / n_s (n_s: targets of the whole sequence)
  seq-mean-token-sum       D = N                                 w = 1
  seq-mean-token-sum-norm  D = N * C (C = `scale_factor`, set)   w = 1
  token-sum                D = 1 (no count needed)               w = 1
T comes from `<name>_tokens` (valid entries of `<name>_labels`; `labels` -> `foundation_tokens`), N from
`<name>_sequences` (entries of `<name>_seq_starts`); both are counted on SP-sliced micro-batches, so the shards
partition them and the world sum counts each once. `mark_sequences` writes the starts and weights from `sequence_ids`
and the labels of the WHOLE sequence, so it runs before SP slicing; a sequence cut across shards counts once.

Cost. D of every head that needs one is computed once per step dict (`micro_batches_token_len`, memoized by
identity, strong reference, in a `LossMemo`: the step's own on a `LossStep`, else the module's) by ONE all-reduce
over the dp x sp group of `MAX_LOSS_KEYS` int64 count slots, five agreement slots and, when the step dict has one,
its `STEP_SLOTS` vector (e.g. the MoE global-batch router loss's expert counts, `veomni_lite.models.moe`;
`step_slots` reads its sum, making the reduce before the first forward if need be); later micro-batches: no
collective. Counts stay int64 tensors on their device and nothing is read to the host on an accelerator. Without a
process group (or on one rank): the same math, no collective.

Errors, on every rank alike (whether a call reduces depends only on which dict it gets, never on its contents):
- ranks with different loss keys, modes or scale factor: the agreement slots carry [1, f, f^2, g, g^2] of two 16-bit
  fingerprints of the rank's plan; after the SUM every rank checks W * sum(f^2) == sum(f)^2 (true iff all f agree)
  and raises `LossKeyMismatchError` naming each rank's plan. A buffer in host memory (gloo) is checked at once (one
  read of host memory); on an accelerator the step's scales turn NaN and `verify_loss_keys()` raises at the step's
  existing host read.
- a step dict edited after its first use (a count replaced, added, removed, or changed in place): `LossMemoError`
  naming the keys, on the rank that edited it, before any collective: build a new dict per step.
- a mode that needs N without `<name>_sequences` counted: a KeyError naming what to call.
`reduce_global_loss_token` is VeOmni's explicit form (numbers out, so it reads the host by design); its result as the
4th argument of `mean_global_loss` is used as given, with W = `get_parallel_state().fsdp_size`.
VeOmni under SP differs: its models return the loss already averaged over the SP group (`ReduceLoss`) and its
`mean_global_loss` SP-sums n with an all-reduce per micro-batch and divides by sp. Here `<name>_loss` is the
shard-local mean and n the shard-local count (no SP collective); a `ReduceLoss`-ed loss here gets each shard's
gradient off by the factor sp * n_local / n_sp.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Any

import torch

from veomni_lite.distributed.collectives import all_gather_objects, all_reduce, collective_device, group_size
from veomni_lite.distributed.parallel_state import get_parallel_state
from veomni_lite.loss_keys import (
    IGNORE_INDEX,
    SEQUENCE_IDS,
    loss_weights_key,
    name_of_labels,
    name_of_loss,
    seq_starts_key,
    sequences_key,
    tokens_key,
)

MAX_LOSS_KEYS = 8
STEP_SLOTS = "step_slots"  # a step dict's optional 1-D int64 vector, summed in the step's one all-reduce
LOSS_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")
_FINGERPRINT_BITS = 16  # f < 2**16: W * sum(f^2) and sum(f)^2 stay exact in int64 up to 2**15 ranks

TokenCount = torch.Tensor | int | float

__all__ = [  # grouped: constants, errors, modes, then the functions
    *("IGNORE_INDEX", "LOSS_MODES", "MAX_LOSS_KEYS", "STEP_SLOTS", "LossKeyMismatchError", "LossMemoError"),
    *("LossMemo", "LossModes", "count_loss_token", "mark_sequences", "mean_global_loss", "reduce_global_loss_token"),
    *("reset_loss_memo", "step_slots", "verify_loss_keys"),
]


class LossKeyMismatchError(RuntimeError):
    """Ranks consumed different loss keys (or modes) in the same step."""


class LossMemoError(RuntimeError):
    """A step's token-count dict was edited after `mean_global_loss` first used it."""


@dataclass(frozen=True)
class LossModes:
    """Each head's loss mode: `default`, or `per_head[name]`; `scale_factor` is C of `-norm`."""

    default: str = "token-mean"
    per_head: Mapping[str, str] = field(default_factory=dict)
    scale_factor: float | None = None

    def __post_init__(self) -> None:
        for where, mode in [("loss.mode", self.default), *((f"loss.modes.{k}", v) for k, v in self.per_head.items())]:
            if mode not in LOSS_MODES:
                raise ValueError(f"{where}: unknown loss mode {mode!r}; expected one of {list(LOSS_MODES)}")
        if self.scale_factor is not None and not self.scale_factor > 0:
            raise ValueError(f"loss.scale_factor must be > 0, got {self.scale_factor}")
        if any(mode.endswith("-norm") for mode in (self.default, *self.per_head.values())) and not self.scale_factor:
            raise ValueError(
                "loss.scale_factor must be set for seq-mean-token-sum-norm (the constant C in sum / (N * C)); "
                "it is never taken from the batch"
            )

    @classmethod
    def of(cls, modes: LossModes | str | None) -> LossModes:
        return modes if isinstance(modes, LossModes) else _TOKEN_MEAN if modes is None else cls(default=modes)

    def mode(self, name: str) -> str:
        return self.per_head.get(name, self.default)

    def count_key(self, name: str) -> str | None:
        """The count D is made of: `<name>_tokens`, `<name>_sequences`, or None (token-sum)."""
        mode = self.mode(name)
        if mode == "token-sum":
            return None
        return tokens_key(name) if mode == "token-mean" else sequences_key(name)

    def constant(self, name: str) -> float:
        """The factor of D beside its count: C for `-norm`, else 1."""
        return float(self.scale_factor) if self.mode(name).endswith("-norm") else 1.0

    def needs_sequences(self) -> bool:
        return any(mode.startswith("seq-") for mode in (self.default, *self.per_head.values()))

    def describe(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """What every rank must agree on, per head: its name, mode and C."""
        return tuple(
            f"{name}:{self.mode(name)}" + (f":{self.scale_factor!r}" if self.mode(name).endswith("-norm") else "")
            for name in names
        )


_TOKEN_MEAN = LossModes()


# ---------------------------------------------------------------- sequences and counts (data side)


def mark_sequences(micro_batch: Mapping[str, Any], modes: LossModes | str | None = None) -> dict[str, Any]:
    """`micro_batch` plus, for every labels key whose head is in a per-sequence mode, `<name>_seq_starts` (True at the
    first valid target of each sequence) and, for `seq-mean-token-mean`, `<name>_loss_weights` (1 / n_s at valid
    targets, 0 elsewhere). Sequences are `sequence_ids` (-1: none), or the rows without it. Call it on the whole
    (unsliced) micro-batch, on the host: it reads `torch.unique`'s sizes."""
    modes = LossModes.of(modes)
    out = dict(micro_batch)
    for key, labels in micro_batch.items():
        name = name_of_labels(key) if isinstance(key, str) else None
        if name is None or not modes.mode(name).startswith("seq-"):
            continue
        rows = torch.arange(labels.shape[0], device=labels.device).view(-1, *[1] * (labels.dim() - 1))
        ids = micro_batch.get(SEQUENCE_IDS, rows.expand_as(labels))  # without it: one sequence per row
        if ids.shape != labels.shape:
            raise ValueError(
                f"mark_sequences: {SEQUENCE_IDS!r} has shape {tuple(ids.shape)}, {key!r} {tuple(labels.shape)}"
            )
        valid = ((labels != IGNORE_INDEX) & (ids >= 0)).reshape(-1)
        sequence = (rows * (int(ids.max()) + 1 if ids.numel() else 1) + ids).reshape(-1)[valid]  # unique per row
        _, inverse, counts = torch.unique(sequence, return_inverse=True, return_counts=True)
        positions = torch.nonzero(valid).squeeze(1)
        first = torch.full_like(counts, labels.numel()).scatter_reduce(0, inverse, positions, "amin")
        starts = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
        starts[first] = True
        out[seq_starts_key(name)] = starts.view_as(labels)
        if modes.mode(name) == "seq-mean-token-mean":
            weights = torch.zeros(labels.numel(), dtype=torch.float64, device=labels.device)
            weights[positions] = 1.0 / counts[inverse].double()
            out[loss_weights_key(name)] = weights.view_as(labels)
    return out


def _micro_batches(batches: Any, where: str = "batches") -> Iterator[Mapping[str, Any]]:
    if isinstance(batches, Mapping):
        yield batches
    elif isinstance(batches, (list, tuple)):
        for index, item in enumerate(batches):
            yield from _micro_batches(item, f"{where}[{index}]")
    else:
        raise TypeError(f"count_loss_token: {where} is a {type(batches).__name__}; expected a dict or a list of them")


def count_loss_token(batches: Any) -> dict[str, torch.Tensor]:
    """`<name>_tokens` (valid entries of each `<name>_labels`) and `<name>_sequences` (entries of each
    `<name>_seq_starts`) summed over every micro-batch given (a dict or nested lists of dicts); a micro-batch with a
    true `padding_flag` counts 0. int64 0-d tensors on the labels' device; nothing is read to the host."""
    counts: dict[str, torch.Tensor] = {}
    for batch in _micro_batches(batches):
        flag = batch.get("padding_flag", False)
        for key, value in batch.items():
            name = name_of_labels(key) if isinstance(key, str) else None
            starts = name is None and isinstance(key, str) and key.endswith("_seq_starts")
            if name is None and not starts:
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"count_loss_token: {key!r} is a {type(value).__name__}; expected a tensor")
            if starts:
                count_key, count = sequences_key(key[: -len("_seq_starts")]), value.sum(dtype=torch.int64)
            else:
                count_key, count = tokens_key(name), (value != IGNORE_INDEX).sum()
            if isinstance(flag, torch.Tensor):
                count = torch.where(flag.to(count.device).bool().any(), 0, count)
            elif flag:
                count = torch.zeros_like(count)
            counts[count_key] = counts[count_key] + count if count_key in counts else count
    return counts


# ---------------------------------------------------------------- the step's one all-reduce


def _as_count(value: TokenCount, key: str, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        # A non-blocking copy to the CPU could be read before it lands; copies to an accelerator are stream-ordered.
        return value.to(device, non_blocking=device.type != "cpu")
    if isinstance(value, (Integral, Real)):  # torch.full fills from a kernel argument: no host-to-device copy
        dtype = torch.int64 if isinstance(value, Integral) else torch.float64
        return torch.full((), value, dtype=dtype, device=device)
    raise TypeError(f"{key} is a {type(value).__name__}; expected a tensor or a number")


def _count(token_len: Mapping[str, TokenCount], key: str, which: str, device: torch.device) -> torch.Tensor:
    if key not in token_len:
        hint = (
            "call mark_sequences(micro_batch, modes) on each whole micro-batch before SP slicing and counting"
            if key.endswith("_sequences")
            else f"the batch needs the labels key of {key[: -len('_tokens')]!r}"
        )
        raise KeyError(f"mean_global_loss: {which} has no {key!r} (has {sorted(token_len)}); {hint}")
    return _as_count(token_len[key], f"{which}[{key!r}]", device)


def _fingerprints(plan: tuple[str, ...]) -> tuple[int, int]:
    text = "\x1f".join(plan).encode()
    mask = (1 << _FINGERPRINT_BITS) - 1
    return zlib.crc32(text) & mask, zlib.adler32(text) & mask


def _reduce(
    plan: tuple[str, ...], counts: list[torch.Tensor], device: torch.device, extra: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(totals of `counts` over the dp x sp group, keys_match, totals of `extra`) from ONE all-reduce of the agreement
    buffer: the same size on every rank whatever its plan, `MAX_LOSS_KEYS` count slots, [1, f, f^2, g, g^2], then the
    step's `STEP_SLOTS` vector if it has one (its length is in the plan)."""
    slots = [count.reshape(1).to(torch.int64) for count in counts] if len(counts) <= MAX_LOSS_KEYS else []
    f, g = _fingerprints(plan)
    # Filled on the device from kernel arguments: no host-to-device copy, so no sync.
    trailer = [torch.full((1,), value, dtype=torch.int64, device=device) for value in (1, f, f * f, g, g * g)]
    tail = [] if extra is None else [extra.reshape(-1).to(device=device, dtype=torch.int64)]
    zeros = torch.zeros(MAX_LOSS_KEYS - len(slots), dtype=torch.int64, device=device)
    buffer = torch.cat([*slots, zeros, *trailer, *tail])
    reduced = all_reduce(buffer, op="sum", group=get_parallel_state().world_group)
    t = reduced[MAX_LOSS_KEYS : MAX_LOSS_KEYS + 5]
    keys_match = (t[0] * t[2] == t[1] * t[1]) & (t[0] * t[4] == t[3] * t[3])
    if len(counts) > MAX_LOSS_KEYS:  # after the collective, which every rank then has made
        raise ValueError(f"{len(counts)} counts {list(plan)} exceed MAX_LOSS_KEYS={MAX_LOSS_KEYS}")
    return reduced[: len(counts)], keys_match, reduced[MAX_LOSS_KEYS + 5 :]


def _verdict_now(reduced: torch.Tensor) -> bool:
    """Whether the verdict can be read without a device sync: the buffer lies in host memory."""
    return reduced.device.type == "cpu"


_LOSS_HINT = "Every rank must return the same loss keys with the same modes on every micro-batch."
_COUNT_HINT = "Every rank's micro-batches must carry the same `<name>_labels` keys (all IGNORE_INDEX for none)."


def _key_mismatch_error(plans: list[tuple[str, ...]], hint: str = _LOSS_HINT) -> LossKeyMismatchError:
    """Every rank reaches this together (the verdict is global), so gathering the plans cannot hang."""
    gathered = all_gather_objects([list(plan) for plan in plans], get_parallel_state().world_group)
    detail = "; ".join(f"rank {rank}: {plan}" for rank, plan in enumerate(gathered))
    return LossKeyMismatchError(
        f"loss keys differ across ranks (seen on rank {get_parallel_state().rank}): {detail}. {hint}"
    )


@dataclass
class _Memo:
    """The step's scales, for the step dict `token_len` as it was first used."""

    token_len: Mapping[str, TokenCount]  # held (with its values), so no id below can be reused while the memo lives
    values: tuple[TokenCount, ...]
    snapshot: dict[str, Any]
    key: tuple[tuple[str, ...], LossModes]  # the head names and modes the step started with
    plan: tuple[str, ...]
    scales: dict[str, torch.Tensor]  # W / D per head name, float64 on the loss device
    slots: torch.Tensor  # the step's `STEP_SLOTS` summed over the world (empty without)
    cast: dict[tuple[str, torch.dtype], torch.Tensor] = field(default_factory=dict)  # the scales in a loss dtype

    def scale(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The scale in the loss's compute dtype, cast once per step."""
        if (name, dtype) not in self.cast:
            self.cast[name, dtype] = self.scales[name].to(dtype)
        return self.cast[name, dtype]


def _snapshot(token_len: Mapping[str, TokenCount]) -> dict[str, Any]:
    """Tensors by identity and version counter (an in-place edit bumps it), numbers by value."""
    return {key: (id(v), v._version) if isinstance(v, torch.Tensor) else v for key, v in token_len.items()}


_ABSENT = object()


class LossMemo:
    """Where a step's scales are kept: the step dict reduced last (by identity, strong reference) and the rank-agreement
    verdicts not yet read (an accelerator's). A `LossStep` owns one, so its memo lives and dies with the step; the
    module keeps one for VeOmni's calls of `mean_global_loss` that pass none."""

    def __init__(self) -> None:
        self.step: _Memo | None = None
        self.pending: list[tuple[torch.Tensor, tuple[str, ...]]] = []

    def reset(self) -> None:
        """Drop the memoized step and any pending verdict."""
        self.step = None
        self.pending.clear()

    def scales(
        self, names: tuple[str, ...], modes: LossModes, token_len: Mapping[str, TokenCount], device: torch.device
    ) -> _Memo:
        """The memo of the step dict `token_len` (its W / D per head): kept, or from the step's one all-reduce."""
        memo = self.step
        if memo is not None and memo.token_len is token_len:
            snapshot = _snapshot(token_len)
            if snapshot != memo.snapshot:
                keys = set(snapshot) | set(memo.snapshot)
                edited = sorted(k for k in keys if snapshot.get(k, _ABSENT) != memo.snapshot.get(k, _ABSENT))
                raise LossMemoError(
                    f"mean_global_loss: micro_batches_token_len was edited after its first use in this step (keys "
                    f"{edited}); build a new dict per step (count_loss_token returns one) instead of editing it"
                )
            if (names, modes) != memo.key:
                raise ValueError(
                    f"mean_global_loss: this step started with loss plan {list(memo.plan)}, now "
                    f"{list(modes.describe(names))}; every micro-batch of a step must return the same loss keys with "
                    "the same modes"
                )
            return memo
        extra = token_len.get(STEP_SLOTS)
        plan = modes.describe(names) + (() if extra is None else (f"{STEP_SLOTS}[{extra.numel()}]",))
        reduced = [name for name in names if modes.count_key(name) is not None]
        counts = [_count(token_len, modes.count_key(name), "micro_batches_token_len", device) for name in reduced]
        totals, keys_match, slots = _reduce(plan, counts, device, extra)
        world = group_size(get_parallel_state().world_group)
        scales = {name: torch.full((), float(world), dtype=torch.float64, device=device) for name in names}
        for name, total in zip(reduced, totals.unbind()):
            scales[name] = total.double().clamp(min=1).reciprocal() * (world / modes.constant(name))
        if _verdict_now(keys_match):
            if not bool(keys_match):
                raise _key_mismatch_error([plan])
        else:  # reading it would sync the device: no usable value until `verify` reads it
            scales = {name: torch.where(keys_match, s, torch.full_like(s, float("nan"))) for name, s in scales.items()}
            self.pending.append((keys_match, plan))
        self.step = _Memo(
            token_len, tuple(token_len.values()), _snapshot(token_len), (names, modes), plan, scales, slots
        )
        return self.step

    def verify(self) -> None:
        """Read the pending rank-agreement verdicts (one host read) and raise `LossKeyMismatchError` on every rank."""
        pending = list(self.pending)
        self.pending.clear()
        if pending and not bool(torch.stack([match for match, _ in pending]).all().cpu()):
            raise _key_mismatch_error(sorted({plan for _, plan in pending}))


_MODULE_MEMO = LossMemo()  # VeOmni's calls, which pass no memo


def reset_loss_memo() -> None:
    """Drop the module's memoized step and any pending verdict (VeOmni's calls; a `LossStep` keeps its own). Local:
    call it at the same point on every rank, between steps (a new dict per step never needs it)."""
    _MODULE_MEMO.reset()


def step_slots(
    loss_keys: tuple[str, ...],
    token_len: Mapping[str, TokenCount],
    modes: LossModes | str | None = None,
    *,
    memo: LossMemo | None = None,
) -> torch.Tensor:
    """The step's `STEP_SLOTS` summed over the world, from its one all-reduce, made now if no `mean_global_loss` of
    this step dict has made it yet (with the head names of `loss_keys`: the step's later calls must return them)."""
    slots = token_len.get(STEP_SLOTS)
    if slots is None:
        raise KeyError(f"step_slots: the step dict has no {STEP_SLOTS!r}")
    names = tuple(sorted(name_of_loss(key) for key in loss_keys))
    return (memo or _MODULE_MEMO).scales(names, LossModes.of(modes), token_len, slots.device).slots


def verify_loss_keys() -> None:
    """Read the module memo's pending rank-agreement verdicts (one host read) and raise `LossKeyMismatchError` on
    every rank (a `LossStep` reads its own: `LossStep.verify`).

    Call it where the step reads a value to the host anyway, at the same point on every rank; on CPU
    `mean_global_loss` has already checked.
    """
    _MODULE_MEMO.verify()


# ---------------------------------------------------------------- per micro-batch


def _loss_items(losses: torch.Tensor | Mapping[str, torch.Tensor]) -> list[tuple[str, str, torch.Tensor]]:
    """(loss key, head name, loss) per entry of `losses`, validated."""
    if isinstance(losses, torch.Tensor):
        return [("foundation_loss", "foundation", losses)]
    if not isinstance(losses, Mapping) or not losses:
        raise TypeError(
            f"mean_global_loss: losses is a {type(losses).__name__}; expected a tensor or a non-empty "
            "{'<name>_loss': tensor} dict"
        )
    items = []
    for key, value in losses.items():
        try:
            name = name_of_loss(key)
        except KeyError as exc:
            raise KeyError(f"mean_global_loss: {exc.args[0]}") from None
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"mean_global_loss: {key!r} is a {type(value).__name__}; expected a tensor")
        items.append((key, name, value))
    return items


def _fsdp_size() -> int:
    """W for an explicit 4th argument: VeOmni's `fsdp_size`, the only attribute this path reads."""
    size = get_parallel_state().fsdp_size
    # A process group without a parallel state (plain torch.distributed): FSDP averages over the whole world.
    return size if size != 1 else group_size()


def mean_global_loss(
    losses: torch.Tensor | Mapping[str, torch.Tensor],
    micro_batch_token_len: Mapping[str, TokenCount],
    micro_batches_token_len: Mapping[str, TokenCount],
    global_micro_batches_token_len: Mapping[str, TokenCount] | None = None,
    *,
    modes: LossModes | str | None = None,
    memo: LossMemo | None = None,
) -> dict[str, torch.Tensor]:
    """Each `<name>_loss` scaled to `L * n * W / D` (see the module docstring), keyed as given.

    Without `global_micro_batches_token_len`, D comes from the all-reduce of `micro_batches_token_len` memoized in
    `memo` (default: the module's); with it (tensors or numbers, e.g. from `reduce_global_loss_token`), D is made from
    it as given.
    """
    modes = LossModes.of(modes)
    items = _loss_items(losses)
    device = items[0][2].device
    names = tuple(sorted(name for _, name, _ in items))
    memo = (
        None
        if global_micro_batches_token_len is not None
        else (memo or _MODULE_MEMO).scales(names, modes, micro_batches_token_len, device)
    )
    scaled = {}
    for key, name, loss in items:
        n = _count(micro_batch_token_len, tokens_key(name), "micro_batch_token_len", device)
        dtype = torch.promote_types(loss.dtype, torch.float32)
        scale = (
            memo.scale(name, dtype)
            if memo is not None
            else _given_scale(name, modes, global_micro_batches_token_len, device).to(dtype)
        )
        # n * W / max(D, 1) is finite, so the masked branch passes an exact zero gradient to a NaN loss.
        scaled[key] = torch.where(n > 0, loss, 0.0) * (n * scale)
    return scaled


def _given_scale(name: str, modes: LossModes, given: Mapping[str, TokenCount], device: torch.device) -> torch.Tensor:
    """W / D of `name` from an explicit 4th argument."""
    scale = torch.full((), float(_fsdp_size()), dtype=torch.float64, device=device)
    key = modes.count_key(name)
    if key is None:
        return scale
    total = _count(given, key, "global_micro_batches_token_len", device)
    return scale / (total.double().clamp(min=1) * modes.constant(name))


def reduce_global_loss_token(micro_batches_token_len: Mapping[str, TokenCount]) -> dict[str, float]:
    """Every count of the step summed over the dp x sp group, as Python floats (VeOmni's signature): ONE all-reduce of
    the agreement buffer, then one host read. Ranks whose keys differ all raise `LossKeyMismatchError`."""
    names = tuple(sorted(key for key in micro_batches_token_len if key != STEP_SLOTS))
    device = collective_device(get_parallel_state().world_group)
    counts = [_as_count(micro_batches_token_len[n], f"micro_batches_token_len[{n!r}]", device) for n in names]
    totals, keys_match, _ = _reduce(names, counts, device)
    if not bool(keys_match.cpu()):
        raise _key_mismatch_error([names], _COUNT_HINT)
    by_name = dict(zip(names, totals.cpu().tolist()))
    return {key: float(by_name[key]) for key in names}
