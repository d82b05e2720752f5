"""The trainer's own per-step costs: the real `BaseTrainer` step against a bare loop, interleaved, same processes.

- trainer step: what `BaseTrainer.train()` runs per step on micro-batches that are already sharded: `_agree` (host
  data checks, then one small MAX all-reduce on the CPU control group), `train_step` (count, forward, loss
  normalization, backward, metric records, the grad-norm all-reduce with the non-finite verdict, the wait for the
  previous step's bookkeeping, the one host read, AdamW, LR schedule) and `metrics.end_step` (the window goes to the
  worker thread every `log_interval` steps). The trainer is a `VLMTrainer` built from configs/vlm_tiny.yaml with
  the benchmark's micro-batch size and no eval, checkpoint, TensorBoard, plot or progress bar.
- bare step: the same work without the trainer: the same model (the trainer's initial weights copied), `fully_shard`
  over the same mesh with the same `set_requires_gradient_sync` pattern, the same micro-batches, AdamW with the same
  hyperparameters, the oracle's loss normalization (one device all-reduce of the step's counts, no host read); no
  checks, no clipping, no LR schedule, no metrics.

A check step from equal weights compares the two gradient norms. An untimed round counts each step's collectives
and host reads; interleaved repetitions time both (a step's time is its slowest rank's); a separate instrumented
pass wraps the trainer's own calls (the names `veomni_lite.trainer.base` calls, the trainer's metrics, optimizer and
scheduler methods, `Tensor.tolist` for the host read) and the bare step's pieces, timing each top-level call on the
main thread (a timed call inside another counts in its parent), so every component's time per step is known.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from baselines import Oracle
from harness import MicroBatch, OpCounter, interleaved_times, maybe, summarize

import veomni_lite.trainer.base as base
from examples.vlm_trainer import VLMTrainer
from veomni_lite.config import load_config, replace
from veomni_lite.distributed.fsdp import apply_fsdp, set_gradient_sync
from veomni_lite.distributed.grad_norm import clip_global_grad_norm
from veomni_lite.distributed.parallel_state import destroy_parallel_state, get_parallel_state
from veomni_lite.utils.loss_utils import count_loss_token, reset_loss_memo

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "vlm_tiny.yaml"
REST = "rest: forward, backward, FSDP, Python"
# the components of a step, in display order; each is timed where it applies (trainer, bare or both)
PARTS = (
    "data checks",
    "control all-reduce",
    "token counts",
    "preforward",
    "loss normalization",
    "metric records per micro-batch",
    "grad-norm all-reduce + clip",
    "bookkeeping wait",
    "key verdict",
    "host read",
    "optimizer",
    "LR scheduler",
    "metric records per step",
    "end_step hand-off",
)


class Stopwatch:
    """Seconds per component name, from wrapped calls and blocks; only top-level main-thread calls are timed."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._depth = 0

    @contextlib.contextmanager
    def block(self, name: str) -> Iterator[None]:
        if self._depth or threading.current_thread() is not threading.main_thread():
            yield
            return
        self._depth += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self._depth -= 1

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.block(name):
                return fn(*args, **kwargs)

        return timed

    @contextlib.contextmanager
    def patched(self, targets: list[tuple[str, Any, str]]) -> Iterator[None]:
        """Replace `owner.attr` by a timed wrapper filed under `name` for every (name, owner, attr); restore after."""
        saved = [(owner, attr, getattr(owner, attr), attr in vars(owner)) for _, owner, attr in targets]
        for name, owner, attr in targets:
            setattr(owner, attr, self.wrap(name, getattr(owner, attr)))
        try:
            yield
        finally:
            for owner, attr, original, own in reversed(saved):
                if own:
                    setattr(owner, attr, original)
                else:
                    delattr(owner, attr)

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), Counter()
        return out


def build_trainer(world: int, micro_batch_size: int, log_interval: int, output_dir: str) -> VLMTrainer:
    """configs/vlm_tiny.yaml with the benchmark's micro-batch size (SP 1: dp = world) and no side outputs."""
    config = load_config(CONFIG, world_size=world)
    config = replace(
        config,
        train={
            "micro_batch_size": micro_batch_size,
            "global_batch_size": micro_batch_size * world,
            "max_steps": 10**6,
            "eval_interval": 0,
            "output_dir": output_dir,
        },
        data={"num_samples": 256, "eval_samples": 0},
        checkpoint={"save_interval": 0},
        logging={"log_interval": log_interval, "progress_bar": False, "tensorboard": False, "plot": False},
    )
    return VLMTrainer(config)


def build_bare(trainer: VLMTrainer) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A second copy of the trainer's model (its current weights), sharded the same way, with its own AdamW over the
    same parameter groups."""
    torch.manual_seed(0)
    model = trainer.build_model().to(trainer.device)
    model = apply_fsdp(model, get_parallel_state(), list(model.layers))
    with torch.no_grad():
        for bare, trained in zip(model.parameters(), trainer.model.parameters()):
            bare.copy_(trained)
    # the trainer's own parameter groups and AdamW settings: the same optimizer work in both loops
    return model, base.build_optimizer(model, trainer.config.optim)


def bare_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_keys: tuple[str, ...],
    micro_batches: list[MicroBatch],
    watch: Stopwatch | None = None,
    grad_norm: bool = False,
) -> torch.Tensor | None:
    """Forward, backward (FSDP2, gradient sync on the last micro-batch only), AdamW; the oracle's normalization.

    `grad_norm=True` (the check step) returns the global gradient norm before the update.
    """
    timed = watch.block if watch is not None else lambda name: contextlib.nullcontext()
    oracle = Oracle()
    with timed("token counts"):
        step_tokens = count_loss_token(micro_batches)
    with timed("loss normalization"):
        oracle.start_step(step_tokens, len(micro_batches))
    last = len(micro_batches) - 1
    for index, micro_batch in enumerate(micro_batches):
        set_gradient_sync(model, index == last)
        with timed("token counts"):
            micro_tokens = count_loss_token(micro_batch)
        outputs = model(**micro_batch)
        with timed("loss normalization"):
            loss = sum(oracle.scale({key: outputs[key] for key in loss_keys}, micro_tokens, step_tokens).values())
        loss.backward()
    norm = None
    if grad_norm:
        group = get_parallel_state().world_group
        norm, _ = clip_global_grad_norm(list(model.parameters()), 0.0, torch.zeros(()), group)
    with timed("optimizer"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def trainer_step(trainer: VLMTrainer, micro_batches: list[MicroBatch]) -> None:
    """One step as `BaseTrainer.train()` runs it once the micro-batches are sharded."""
    trainer._agree(micro_batches)
    trainer.train_step(micro_batches)
    trainer.metrics.end_step(trainer.step, trainer.epoch, release=micro_batches)


def trainer_targets(trainer: VLMTrainer) -> list[tuple[str, Any, str]]:
    """What the instrumented pass wraps on the trainer side: (component, owner, attribute)."""
    metrics = trainer.metrics
    return [
        ("data checks", base, "validate_micro_batch"),
        ("control all-reduce", base, "all_reduce"),
        ("token counts", base, "count_loss_token"),
        ("preforward", trainer, "preforward"),
        ("loss normalization", base, "mean_global_loss"),
        ("metric records per micro-batch", metrics, "record_micro_batch"),
        ("grad-norm all-reduce + clip", base, "clip_global_grad_norm"),
        ("bookkeeping wait", metrics, "wait_bookkeeping"),
        ("key verdict", base, "verify_loss_keys"),
        ("host read", torch.Tensor, "tolist"),
        ("optimizer", trainer.optimizer, "step"),
        ("LR scheduler", trainer.scheduler, "step"),
        ("metric records per step", metrics, "record_step"),
        ("end_step hand-off", metrics, "end_step"),
    ]


def rank_mean(rows: list[list[float]]) -> list[list[float]]:
    """Element-wise mean over ranks of a steps x columns table (one all-reduce, untimed)."""
    table = torch.tensor(rows, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(table)
        table /= dist.get_world_size()
    return table.tolist()


def breakdown(steps: dict[str, Callable[[int], Any]], watch: Stopwatch, reps: int) -> dict[str, dict[str, Any]]:
    """`reps` instrumented repetitions of every step, interleaved as the timed ones are; per step name, the median
    ms per step of every component (rank mean per step) and of the step."""
    rows: dict[str, list[list[float]]] = {name: [] for name in steps}
    for rep in range(reps):
        for name, step in steps.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            step(rep)
            total = time.perf_counter() - start
            parts = watch.take()
            rows[name].append([parts.get(part, 0.0) for part in PARTS] + [total - sum(parts.values()), total])
    out = {}
    for name, table in rows.items():
        columns = zip(*rank_mean(table))
        medians = {part: summarize(column)["median"] * 1e3 for part, column in zip((*PARTS, REST, "step"), columns)}
        out[name] = {"breakdown_ms": medians, "instrumented_steps": reps}
    return out


def check_equal_work(
    trainer: VLMTrainer, model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[MicroBatch]
) -> dict[str, float]:
    """One step of each from equal weights and data: the trainer's gradient norm (its clip's input) must equal the
    bare step's (AssertionError otherwise)."""
    norms: list[torch.Tensor] = []
    clip = base.clip_global_grad_norm

    def keep_norm(*args: Any, **kwargs: Any) -> Any:
        out = clip(*args, **kwargs)
        norms.append(out[0].detach().clone())
        return out

    base.clip_global_grad_norm = keep_norm
    try:
        trainer_step(trainer, micro_batches)
    finally:
        base.clip_global_grad_norm = clip
    bare_norm = bare_step(model, optimizer, trainer.loss_keys, micro_batches, grad_norm=True)
    assert bare_norm is not None
    diff = float((norms[0] - bare_norm).abs() / bare_norm.abs().clamp(min=1e-30))
    if diff > 1e-4:
        raise AssertionError(f"trainer and bare step differ: grad norms {float(norms[0])} vs {float(bare_norm)}")
    return {"grad_norm_rel_diff": diff}


def bench_trainer(
    world: int,
    data_by_ga: dict[int, list[list[MicroBatch]]],
    micro_batch_size: int,
    log_interval: int,
    reps_for: Callable[[float], int],
    counter: OpCounter,
) -> list[dict[str, Any]]:
    """Trainer step vs bare step at every GA of `data_by_ga` (SP 1); records like the worker's, bench "trainer".

    `reps_for(seconds of one warm-up repetition)` gives the number of timed repetitions.
    """
    records: list[dict[str, Any]] = []
    # One output directory every rank shares (the trainer refuses one that some rank cannot see).
    output_dir = Path(tempfile.gettempdir()) / f"bench_trainer_{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, output_dir, ignore_errors=True)
        trainer = build_trainer(world, micro_batch_size, log_interval, str(output_dir))
        keys = trainer.loss_keys
        try:
            model, optimizer = build_bare(trainer)
            check = check_equal_work(trainer, model, optimizer, next(iter(data_by_ga.values()))[0])
            for ga, data in data_by_ga.items():
                steps = {
                    "trainer": lambda rep, d=data: trainer_step(trainer, d[rep % len(d)]),
                    "bare": lambda rep, d=data: bare_step(model, optimizer, keys, d[rep % len(d)]),
                }
                counts = {}
                for name, run in steps.items():
                    counter.reset()
                    with counter.active(), maybe(counter, "step"):
                        run(0)
                    counts[name] = counter.snapshot(steps=1)
                warm = interleaved_times(steps, reps=1)
                reps = reps_for(sum(values[0] for values in warm.values()))
                cpu: dict[str, list[float]] = {}
                times = interleaved_times(steps, reps=reps, rotate_offset=1, cpu_times=cpu)
                watch = Stopwatch()

                def watched_trainer(rep: int, d: list[list[MicroBatch]] = data, w: Stopwatch = watch) -> None:
                    with w.patched(trainer_targets(trainer)):
                        trainer_step(trainer, d[rep % len(d)])

                def watched_bare(rep: int, d: list[list[MicroBatch]] = data, w: Stopwatch = watch) -> None:
                    bare_step(model, optimizer, keys, d[rep % len(d)], w)

                watched = {"trainer": watched_trainer, "bare": watched_bare}
                parts = breakdown(watched, watch, max(3, min(reps, 8)))
                for name in steps:
                    records.append(
                        {
                            "bench": "trainer",
                            "kind": "step",
                            "world": world,
                            "dp": world,
                            "sp": 1,
                            "ga": ga,
                            "strategy": name,
                            "label": LABELS[name],
                            "times_s": times[name],
                            "reps": len(times[name]),
                            **{f"{k}_s": v for k, v in summarize(times[name]).items()},
                            "cpu_times_s": cpu[name],
                            "counts": counts[name],
                            "check": check,
                            "log_interval": log_interval,
                            **parts[name],
                        }
                    )
            trainer.metrics.finish(trainer.step, trainer.epoch)
        finally:
            trainer.metrics.close()
            destroy_parallel_state()
            reset_loss_memo()
    return records


LABELS = {
    "trainer": "BaseTrainer step (_agree + train_step + end_step)",
    "bare": "bare loop (FSDP2 + AdamW, oracle normalization, no metrics)",
}
