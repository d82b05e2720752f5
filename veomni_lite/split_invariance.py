"""Prove a model's loss heads are normalized exactly: the same global batch under several splits, one gradient.

`check_split_invariance(build_model, samples, collate, modes=...)` trains one optimizer step of `build_model()` on
`samples` (the whole global batch) in one process with one micro-batch (the reference), then under each `Layout`
(gradient accumulation, DP and Ulysses SP, on real gloo processes of this machine; a one-process layout runs in this
process) through the trainer's call sequence: `mark_sequences` on the whole micro-batch, `slice_micro_batch` for SP,
then `LossStep` (the step counted once, `mean_global_loss` per micro-batch), backward, gradients averaged over dp x sp
as FSDP does. It returns a
`SplitReport`: per layout and mode, the largest gradient difference (relative to the largest reference gradient
entry) and the absolute loss difference against the reference, and the loss all-reduces each step issued (1 is the
contract on more than one process, 0 on one).

The processes are forked from multiprocessing's forkserver, which imports `__main__` and `build_model`'s module once,
so layouts after the first pay no imports again.
`build_model` and `collate` are called in every process, so they must be importable (module-level) functions; the
model follows the trainer's model contract (`forward(**micro_batch)` returns `{"<name>_loss": local mean}`, and
`enable_sequence_parallel(group)` for SP layouts, and `extra_counts(micro_batch)` for heads counted without labels, as
the MoE router heads); `collate(samples) -> micro_batch` shifts labels once and pads.
Samples go to micro-batches in order: micro-batch j of dp rank r holds samples [(j * dp + r) * mbs, ... + mbs);
a `Layout` may pack them (`packed_collate`) and re-plan each rank's samples by a token budget.
Build the model in float64 to see differences at rounding level (~1e-15); float32 shows ~1e-7.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from veomni_lite.data.packing import padding_micro_batch, plan_micro_batches
from veomni_lite.distributed.parallel_state import destroy_parallel_state, get_parallel_state, init_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.plain_loop import LossStep
from veomni_lite.utils.loss_utils import LossModes, mark_sequences

__all__ = ["Layout", "SplitReport", "check_split_invariance", "default_layouts"]


@dataclass(frozen=True)
class Layout:
    """`dp` x `sp` processes, `micro_batch_size` samples per micro-batch (GA = samples / (mbs x dp)). `packed`: each
    micro-batch through `packed_collate`; `max_tokens` > 0: each rank's samples re-planned into token-budget
    micro-batches (`plan_micro_batches`), the ranks with fewer padded with no-target micro-batches as the trainer
    does."""

    dp: int = 1
    sp: int = 1
    micro_batch_size: int = 1
    packed: bool = False
    max_tokens: int = 0

    def __str__(self) -> str:
        extra = ("/packed" if self.packed else "") + (f"/budget{self.max_tokens}" if self.max_tokens else "")
        return f"dp{self.dp}xsp{self.sp}/mbs{self.micro_batch_size}{extra}"


def default_layouts(num_samples: int) -> list[Layout]:
    """GA k x 1 sample, DP=2, SP=2 and DP=2 x SP=2 (GA 1 x all samples is the reference itself)."""
    half = max(num_samples // 2, 1)
    return [Layout(1, 1, 1), Layout(2, 1, max(half // 2, 1)), Layout(1, 2, half), Layout(2, 2, max(half // 2, 1))]


@dataclass
class SplitReport:
    """Differences against the one-process reference, per (layout, mode): max |g - g_ref| / max |g_ref| over every
    parameter, and |loss - loss_ref|."""

    grad_diff: dict[tuple[str, str], float] = field(default_factory=dict)
    loss_diff: dict[tuple[str, str], float] = field(default_factory=dict)
    collectives_per_step: dict[str, int] = field(default_factory=dict)
    grads: dict[tuple[str, str], list[torch.Tensor]] = field(default_factory=dict)  # "reference" included
    losses: dict[tuple[str, str], float] = field(default_factory=dict)

    def worst(self) -> float:
        return max([*self.grad_diff.values(), *self.loss_diff.values()], default=0.0)

    def __str__(self) -> str:
        rows = [f"{'layout':<18} {'mode':<45} {'max grad diff':>16} {'|loss diff|':>12} {'loss all-reduces':>16}"]
        for (layout, mode), diff in self.grad_diff.items():
            calls = self.collectives_per_step[layout]
            rows.append(f"{layout:<18} {mode:<45} {diff:>16.3e} {self.loss_diff[layout, mode]:>12.3e} {calls:>16}")
        return "\n".join(rows)


def _mode_name(modes: LossModes) -> str:
    return ",".join([modes.default, *(f"{k}={v}" for k, v in sorted(modes.per_head.items()))])


def _one_step(model: torch.nn.Module, micro_batches: list[dict[str, Any]], modes: LossModes) -> tuple[float, int]:
    """Forward/backward of one step; returns (this rank's summed scaled loss, loss all-reduces issued)."""
    calls = []
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        step = LossStep(micro_batches, modes, marked=True, extra_counts=getattr(model, "extra_counts", None))
        total = 0.0
        for micro_batch, tokens in step:
            outputs = model(**micro_batch)
            loss = step.loss({key: outputs[key] for key in model.loss_keys}, tokens)
            loss.backward()
            total += float(loss.detach())
        step.verify()
    finally:
        dist.all_reduce = original
    return total, len(calls)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _chunks(layout: Layout, samples: Sequence[Any], dp_rank: int) -> list[list[Any]]:
    """Rank `dp_rank`'s samples, one list per micro-batch, padded to every rank's largest count with empty lists."""
    mbs, dp = layout.micro_batch_size, layout.dp
    steps = range(len(samples) // (mbs * dp))
    plans = []
    for rank in range(dp):
        mine = [s for j in steps for s in samples[(j * dp + rank) * mbs : (j * dp + rank + 1) * mbs]]
        if layout.max_tokens:
            lengths = [int(s["input_ids"].numel()) for s in mine]
            plans.append(
                [[mine[i] for i in chunk] for chunk in plan_micro_batches(lengths, layout.max_tokens, layout.packed)]
            )
        else:
            plans.append([mine[j * mbs : (j + 1) * mbs] for j in steps])
    count = max(len(plan) for plan in plans)
    return plans[dp_rank] + [[] for _ in range(count - len(plans[dp_rank]))]


def _run(
    layout: Layout,
    build_model: Callable[[], Any],
    samples: Sequence[Any],
    collate: Callable,
    modes: list[LossModes],
    packed_collate: Callable | None = None,
) -> dict[str, Any]:
    """This process's share of `layout` for every mode; gradients and losses averaged over the mesh."""
    state = get_parallel_state()
    model = build_model()
    if layout.sp > 1:
        model.enable_sequence_parallel(state.sp_group)
    make = packed_collate if layout.packed else collate
    out: dict[str, Any] = {"grads": [], "losses": [], "calls": []}
    for loss_modes in modes:
        model.zero_grad(set_to_none=True)
        chunks = _chunks(layout, samples, state.dp_rank)
        marked = [mark_sequences(make(chunk or chunks[0]), loss_modes) for chunk in chunks]
        marked = [batch if chunk else padding_micro_batch(batch) for batch, chunk in zip(marked, chunks)]
        micro_batches = [slice_micro_batch(batch, state.sp_rank, layout.sp) for batch in marked]
        loss, calls = _one_step(model, micro_batches, loss_modes)
        world = state.world_size
        grads = _grads(model)
        if world > 1:
            for grad in grads:
                dist.all_reduce(grad)
                grad /= world
            loss_sum = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(loss_sum)
            loss = float(loss_sum) / world
        out["grads"].append(grads)
        out["losses"].append(loss)
        out["calls"].append(calls)
    return out


def _worker(rank: int, world: int, init_file: str, result_file: str, args: tuple) -> None:
    torch.set_num_threads(1)
    layout = args[0]
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    try:
        init_parallel_state(layout.dp, layout.sp, timeout_s=120)
        result = _run(*args)
        if rank == 0:
            torch.save(result, result_file)
    finally:
        destroy_parallel_state()
        dist.destroy_process_group()


def check_split_invariance(
    build_model: Callable[[], Any],
    samples: Sequence[Mapping[str, torch.Tensor]],
    collate: Callable[[Sequence[Mapping[str, torch.Tensor]]], dict[str, Any]],
    modes: Sequence[LossModes | str] = ("token-mean",),
    layouts: Sequence[Layout] | None = None,
    packed_collate: Callable[[Sequence[Mapping[str, torch.Tensor]]], dict[str, Any]] | None = None,
) -> SplitReport:
    """Run every layout for every mode and compare with the one-process, one-micro-batch reference (see above);
    `packed_collate` makes the micro-batches of the `packed` layouts (the reference is always `collate`'s)."""
    modes = [LossModes.of(mode) for mode in modes]
    layouts = default_layouts(len(samples)) if layouts is None else list(layouts)
    for layout in layouts:
        if layout.packed and packed_collate is None:
            raise ValueError(f"layout {layout}: a packed layout needs packed_collate")
        if len(samples) % (layout.micro_batch_size * layout.dp):
            raise ValueError(f"layout {layout}: {len(samples)} samples do not split into micro-batches x dp")
    report = SplitReport()
    reference = _run(Layout(1, 1, len(samples)), build_model, samples, collate, modes)
    for mode, grads, loss in zip(modes, reference["grads"], reference["losses"]):
        report.grads["reference", _mode_name(mode)] = grads
        report.losses["reference", _mode_name(mode)] = loss
    for layout in layouts:
        args = (layout, build_model, samples, collate, modes, packed_collate)
        world = layout.dp * layout.sp
        if world == 1:  # one process: here, like the reference (no process group, no collective)
            result = _run(*args)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                result_file = os.path.join(tmp, "result.pt")
                init = os.path.join(tmp, "init")
                mp.get_context("forkserver").set_forkserver_preload(["__main__", build_model.__module__])
                start = {"nprocs": world, "start_method": "forkserver"}
                mp.start_processes(_worker, args=(world, init, result_file, args), **start)
                result = torch.load(result_file, weights_only=True)
        name = str(layout)
        report.collectives_per_step[name] = max(result["calls"])
        for mode, grads, loss in zip(modes, result["grads"], result["losses"]):
            key = (name, _mode_name(mode))
            ref_grads, ref_loss = report.grads["reference", key[1]], report.losses["reference", key[1]]
            scale = max(float(r.abs().max()) for r in ref_grads) or 1.0
            report.grad_diff[key] = max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) / scale
            report.loss_diff[key] = abs(loss - ref_loss)
            report.grads[key], report.losses[key] = grads, loss
    return report
