"""One all-reduce helper for scalars, lists and tensors.

Contract:
- `op` is "sum", "mean", "max" or "min" (mean = sum / group size, so it works on gloo too).
- A list/tuple is packed into ONE collective and returned as a list of the same length.
- Integer data is reduced as int64 (exact beyond 2**24), floats as float64 for Python numbers and in their own dtype
  for tensors; an integer "mean" returns floats.
- A tensor in gives a tensor out, never `.item()`; Python numbers in give Python numbers out.
- Without an initialized process group, or with a group of size 1, the local value comes back and nothing is sent.
- A failed or timed-out collective raises CollectiveError naming the rank, the op, shape and dtype.

`all_gather_objects` gathers one picklable value per rank, for error paths that every rank reaches together.
`agreed_count` is the length every rank gives a pass that runs a collective per item of a list of its own (an FSDP
forward per planned micro-batch): no rank may call fewer collectives than another.
`destroy_process_groups` is how a process run by torchrun tears them down before it exits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from numbers import Number
from typing import Any

import torch
import torch.distributed as dist

ReduceData = Number | torch.Tensor | Sequence[Number | torch.Tensor]


class CollectiveError(RuntimeError):
    """A collective that failed or timed out; the message names the rank and the collective."""


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """World size of `group` (default group when None); 1 without an initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a collective on `group` needs its buffers on: the current CUDA device for NCCL, else CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_integer(x: Number | torch.Tensor) -> bool:
    if isinstance(x, torch.Tensor):
        return not (x.dtype.is_floating_point or x.dtype.is_complex)
    return isinstance(x, (bool, int))


def _reduce_tensor(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None, size: int) -> torch.Tensor:
    integer = _is_integer(tensor)
    out = tensor.detach().to(torch.int64 if integer else tensor.dtype, copy=True)
    if size > 1:
        try:
            dist.all_reduce(out, op=_REDUCE_OPS[op], group=group)
        except RuntimeError as exc:  # a timeout or a peer that died: say which rank and which collective
            raise CollectiveError(
                f"rank {dist.get_rank()}: all_reduce(op={op}, shape={tuple(out.shape)}, dtype={out.dtype}) over a "
                f"group of {size} ranks failed: {exc}"
            ) from exc
    if op == "mean":
        out = out.to(torch.float64) / size if integer else out / size
    return out


def all_reduce(data: ReduceData, op: str = "sum", group: dist.ProcessGroup | None = None) -> ReduceData:
    """Reduce `data` over `group` (see the module docstring for the contract)."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {sorted(_REDUCE_OPS)}")
    size = group_size(group)

    if isinstance(data, torch.Tensor):
        return _reduce_tensor(data, op, group, size)

    if isinstance(data, (list, tuple)):
        if not data:
            return []
        for index, item in enumerate(data):
            if not isinstance(item, (Number, torch.Tensor)) or (isinstance(item, torch.Tensor) and item.numel() != 1):
                raise TypeError(f"all_reduce: list item {index} is {type(item).__name__}; expected a number")
        integer = all(_is_integer(item) for item in data)
        dtype = torch.int64 if integer else torch.float64
        if any(isinstance(item, torch.Tensor) for item in data):
            device = next(item.device for item in data if isinstance(item, torch.Tensor))
            packed = torch.stack([torch.as_tensor(item, dtype=dtype, device=device).reshape(()) for item in data])
            return list(_reduce_tensor(packed, op, group, size).unbind())
        packed = torch.tensor(list(data), dtype=dtype, device=collective_device(group))
        return _reduce_tensor(packed, op, group, size).tolist()

    if isinstance(data, Number):
        integer = _is_integer(data)
        packed = torch.tensor([data], dtype=torch.int64 if integer else torch.float64, device=collective_device(group))
        return _reduce_tensor(packed, op, group, size).item()

    raise TypeError(f"all_reduce: unsupported data type {type(data).__name__}; expected a number, list or tensor")


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj`, in group-rank order (`[obj]` without a process group). Collective: error paths only."""
    size = group_size(group)
    if size == 1:
        return [obj]
    gathered: list[Any] = [None] * size
    try:
        dist.all_gather_object(gathered, obj, group=group)
    except RuntimeError as exc:
        message = f"rank {dist.get_rank()}: all_gather_object over a group of {size} ranks failed: {exc}"
        raise CollectiveError(message) from exc
    return gathered


def agreed_count(count: int, group: dist.ProcessGroup | None = None) -> int:
    """Collective: the largest `count` over the ranks of `group` (one MAX all-reduce of one int64; `count` itself
    without a process group). A pass that runs a collective per item of a list whose length this rank's own data
    decides (e.g. one FSDP forward per micro-batch of a token-budget plan) runs this many items on every rank, a
    shorter list padded with items whose results are dropped, as a train step pads with `padding_flag`
    micro-batches: else a rank that is done waits in its next collective while another waits in a forward."""
    return int(all_reduce(int(count), op="max", group=group))


def rank_problems(
    problem: BaseException | str | None, group: dist.ProcessGroup | None = None, flags: Sequence[int] = ()
) -> tuple[dict[int, str], list[int]]:
    """Collective: every rank's problem (None: this rank has none), agreed. One MAX all-reduce of [has a problem,
    *flags]; only when some rank has a problem, one all-gather of the messages (an error path every rank reaches
    together). Returns ({global rank: message} of the ranks with a problem, the `flags` reduced by MAX)."""
    reduced = all_reduce([int(problem is not None), *flags], op="max", group=group)
    if not reduced[0]:
        return {}, reduced[1:]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    gathered = all_gather_objects((rank, None if problem is None else str(problem)), group)
    return {r: message for r, message in gathered if message is not None}, reduced[1:]


def agree(
    problem: BaseException | str | None,
    error: type[Exception],
    group: dist.ProcessGroup | None = None,
    flags: Sequence[int] = (),
    where: str = "",
) -> list[int]:
    """Collective: "if any rank has a problem, every rank raises `error`, naming each such rank and its cause"
    (`where` + "rank R: cause; ..."), before any later collective could wait for a rank that stopped. Call it at the
    same point on every rank, with the problem this rank met (e.g. the exception it caught) or None. Else returns
    `flags` reduced by MAX (other agreed values folded into the same all-reduce)."""
    problems, reduced = rank_problems(problem, group, flags)
    if problems:
        agreed = error(where + name_problems(problems))
        agreed.agreed = True  # every rank raises it: a caller need not agree on it again
        raise agreed from (problem if isinstance(problem, BaseException) else None)
    return reduced


def name_problems(problems: dict[int, str]) -> str:
    """`rank_problems`' result in words, ranks with the same message together: "ranks 0, 1: cause; rank 3: other"."""
    ranks: dict[str, list[int]] = {}
    for rank, message in sorted(problems.items()):
        ranks.setdefault(message, []).append(rank)
    return "; ".join(
        f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}: {message}" for message, who in ranks.items()
    )


def destroy_process_groups() -> None:
    """Destroy every process group (when one is up), then sleep 50 ms with the GIL released.

    Why the sleep: a gloo worker thread drops a finished collective's tensors just after `wait()` returned, and that
    needs the GIL. If it asks for it once the interpreter is finalizing, the process aborts with "terminate called
    without an active exception" (pytorch/pytorch#179291; 4 of 26 torchrun runs of the GPU audit's dry run did so
    here, 0 of 48 with the sleep)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.05)
