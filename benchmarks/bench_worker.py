"""torchrun worker: loss-normalization and metric strategies side by side on one world size (gloo, CPU).

Launched by `benchmarks/run_all.py` as `torchrun --standalone --nproc_per_node N benchmarks/bench_worker.py ...`.
For every SP size and GA value it times two kinds of optimizer step, strategies interleaved:
- "vlm": the tiny VLM (count_loss_token, forward, loss scaling, backward per micro-batch; then ONE flat gradient
  all-reduce and AdamW, identical for every strategy; no FSDP, so the gradient sync is one counted collective);
- "path": the loss (or metric) path alone: the same micro-batches, labels and counts, with each loss a scalar
  parameter times a fixed local mean, so only normalization, its collectives and host reads remain (the oracle's
  path is its floor: the same losses and backward, one bare 1-element all-reduce, no scaling).
Before timing, one untimed round per strategy counts collectives (and the elements they send) and host reads by
phase and checks that every strategy gives the same gradients and world-summed loss as veomni_lite, on the heads it
normalizes globally (all of them, except for the HF Trainer's scheme: `labels` only). Then, at SP 1, the real
`BaseTrainer` step against a bare FSDP2 loop (benchmarks/trainer_costs.py), and the all-reduce latency probe. Rank
0 writes the JSON given by `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from baselines import (
    LOSS_STRATEGIES,
    METRIC_STRATEGIES,
    LogTimeMetrics,
    LossStrategy,
    MetricStrategy,
    Oracle,
    VeOmniLite,
)
from harness import (
    MicroBatch,
    OpCounter,
    agree_max,
    interleaved_times,
    machine_description,
    make_steps,
    maybe,
    peak_rss_kib,
    rss_kib,
    summarize,
    vlm_dataset,
)
from trainer_costs import bench_trainer

from veomni_lite.distributed.parallel_state import destroy_parallel_state, init_parallel_state
from veomni_lite.distributed.sequence_parallel import ulysses_attention
from veomni_lite.examples.attention import causal_attention
from veomni_lite.examples.tiny_lm import TinyLMConfig, set_attention_fn
from veomni_lite.examples.tiny_vlm import TinyVLM, TinyVLMConfig
from veomni_lite.metrics import train_metric_specs
from veomni_lite.utils import loss_utils
from veomni_lite.utils.loss_utils import count_loss_token, reset_loss_memo

LOSS_KEYS = ("foundation_loss", "image_decoder_loss")
MICRO_BATCH_SIZE = 2
DATA_STEPS = 2  # distinct global batches per config, cycled

METRIC_SPECS = tuple(train_metric_specs(list(LOSS_KEYS)))  # what the trainer records, in its order
MODEL_DIMS = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 176}  # configs/vlm_tiny.yaml
# equal-correctness tolerances (relative): gradients of the VLM step and of the path alone, step loss, logged metrics
TOLERANCES = {"vlm_grad": 1e-4, "path_grad": 1e-5, "loss": 1e-5, "metrics": 1e-9}


# ----------------------------------------------------------------------------------------------------- the model


def build_model(vocab_size: int, num_image_codes: int, image_token_id: int, sp_size: int, sp_group: Any) -> TinyVLM:
    """The tiny VLM of configs/vlm_tiny.yaml (2 layers, hidden 64), same weights on every rank."""
    torch.manual_seed(0)
    model = TinyVLM(
        TinyVLMConfig(
            lm=TinyLMConfig(vocab_size=vocab_size, **MODEL_DIMS),
            num_image_codes=num_image_codes,
            image_token_id=image_token_id,
        )
    )
    if sp_size > 1:
        set_attention_fn(model, ulysses_attention(causal_attention, sp_group))
    return model


def sync_gradients(params: list[torch.nn.Parameter], world: int) -> torch.Tensor:
    """Average gradients over the world with ONE flat all-reduce (what DDP/FSDP do per bucket); returns the flat."""
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        numel = p.numel()
        p.grad = flat[offset : offset + numel].view_as(p).clone()
        offset += numel
    return flat


# ----------------------------------------------------------------------------------------------------- loss steps


def vlm_loss_step(
    strategy: LossStrategy,
    model: TinyVLM,
    optimizer: torch.optim.Optimizer | None,
    micro_batches: list[MicroBatch],
    world: int,
    counter: OpCounter | None = None,
    heads: tuple[str, ...] = LOSS_KEYS,
) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """One optimizer step of the VLM with `strategy`'s loss scaling; (every micro-batch's scaled losses, flat grads).

    Only `heads` are backpropagated (a check round may compare one head); `optimizer=None` leaves the gradients in
    place (the check round).
    """
    with maybe(counter, "step"):
        step_tokens = count_loss_token(micro_batches)
        strategy.start_step(step_tokens, len(micro_batches))
        parts = []
        for micro_batch in micro_batches:
            micro_tokens = count_loss_token(micro_batch)
            outputs = model(**micro_batch)
            scaled = strategy.scale({key: outputs[key] for key in heads}, micro_tokens, step_tokens)
            loss = sum(scaled.values())
            loss.backward()
            parts.append(scaled)
    params = list(model.parameters())
    with maybe(counter, "grad_sync"):
        flat = sync_gradients(params, world)
    if optimizer is not None:
        with maybe(counter, "optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return parts, flat


def head_totals(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{head: sum over micro-batches} of the scaled losses a step kept (summed after the step, outside its work)."""
    return {key: sum(part[key].detach() for part in parts) for key in parts[0]}


def path_loss_step(
    strategy: LossStrategy,
    weights: Mapping[str, torch.nn.Parameter],
    micro_batches: list[MicroBatch],
    local_means: list[dict[str, torch.Tensor]],
    counter: OpCounter | None = None,
) -> list[dict[str, torch.Tensor]]:
    """The loss path alone: per micro-batch, `loss_k = w_k * local_mean_k`, scaled by `strategy`, backpropagated.

    The oracle's path is its floor: the same losses and backward, one bare 1-element all-reduce, no scaling.
    Returns the scaled losses of every micro-batch (`head_totals` sums them per head).
    """
    with maybe(counter, "step"):
        floor = isinstance(strategy, Oracle)
        if floor:
            strategy.path_count(micro_batches)
        else:
            step_tokens = count_loss_token(micro_batches)
            strategy.start_step(step_tokens, len(micro_batches))
        parts = []
        for micro_batch, means in zip(micro_batches, local_means):
            losses = {key: weights[key] * means[key] for key in LOSS_KEYS}
            scaled = losses if floor else strategy.scale(losses, count_loss_token(micro_batch), step_tokens)
            loss = sum(scaled.values())
            loss.backward()
            parts.append(scaled)
    return parts


def path_runner(
    strategy: LossStrategy,
    weights: Mapping[str, torch.nn.Parameter],
    data: list[list[MicroBatch]],
    means: list[list[dict[str, torch.Tensor]]],
) -> Callable[[int], None]:
    """A timed-step callable: repetition `rep` runs the loss path on step `rep % len(data)`, then drops the grads."""

    def run(rep: int) -> None:
        path_loss_step(strategy, weights, data[rep % len(data)], means[rep % len(data)])
        for weight in weights.values():
            weight.grad = None

    return run


def fixed_local_means(micro_batches: list[MicroBatch], seed: int) -> list[dict[str, torch.Tensor]]:
    """A deterministic positive local mean per loss key and micro-batch; exactly 0 where the shard has no token."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for micro_batch in micro_batches:
        tokens = count_loss_token(micro_batch)
        out.append(
            {
                key: torch.where(
                    tokens[key[: -len("_loss")] + "_tokens"] > 0,
                    torch.rand((), generator=generator) + 0.5,
                    torch.zeros(()),
                )
                for key in LOSS_KEYS
            }
        )
    return out


# -------------------------------------------------------------------------------------------------- metric steps


def record_micro_batch(
    metrics: MetricStrategy, losses: Mapping[str, torch.Tensor], micro_batch: MicroBatch, flops_per_token: float
) -> None:
    """The values veomni_lite's TrainMetrics records for a micro-batch (token-weighted loss means, tokens, samples,
    FLOPs), one record each, so both metric strategies see every micro-batch's records (TrainMetrics itself folds a
    step's micro-batches into one record per metric)."""
    tokens = count_loss_token(micro_batch)
    for key in LOSS_KEYS:
        count = tokens[key[: -len("_loss")] + "_tokens"]
        local_mean = torch.where(count > 0, losses[key].detach(), torch.zeros_like(losses[key]))
        metrics.record(key, local_mean.float(), count=count)
    seen = (micro_batch["input_ids"] != 0).sum()
    metrics.record("tokens", seen)
    metrics.record("samples", float(micro_batch["input_ids"].shape[0]))
    metrics.record("flops", seen.double() * flops_per_token)


def record_step(metrics: MetricStrategy, grad_norm: torch.Tensor, lr: float, step_time: float, peak_mb: float) -> None:
    """What veomni_lite's TrainMetrics records per step (no step-end worker to wait for, no skipped step: zeros)."""
    metrics.record("grad_norm", grad_norm.float())
    metrics.record("lr", lr)
    metrics.record("step_time_s", step_time)
    metrics.record("bookkeeping_wait_s", 0.0)
    metrics.record("skipped_steps", 0.0)
    metrics.record("peak_mem_mb", peak_mb)


def vlm_metrics_step(
    metrics: MetricStrategy,
    model: TinyVLM,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[MicroBatch],
    world: int,
    flops_per_token: float,
    counter: OpCounter | None = None,
) -> dict[str, float]:
    """A veomni_lite VLM step (loss (c)) that records the trainer's metrics with `metrics` and logs every step."""
    start = time.perf_counter()
    strategy = VeOmniLite()
    with maybe(counter, "step"):
        step_tokens = count_loss_token(micro_batches)
        for micro_batch in micro_batches:
            micro_tokens = count_loss_token(micro_batch)
            outputs = model(**micro_batch)
            losses = {key: outputs[key] for key in LOSS_KEYS}
            loss = sum(strategy.scale(losses, micro_tokens, step_tokens).values())
            loss.backward()
            with maybe(counter, "metrics"):
                record_micro_batch(metrics, losses, micro_batch, flops_per_token)
    with maybe(counter, "grad_sync"):
        flat = sync_gradients(list(model.parameters()), world)
        grad_norm = flat.norm()
    with maybe(counter, "metrics"):
        record_step(metrics, grad_norm, optimizer.param_groups[0]["lr"], time.perf_counter() - start, peak_rss_kib())
        logged = metrics.log()
    with maybe(counter, "optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return logged


def path_metrics_step(
    metrics: MetricStrategy,
    micro_batches: list[MicroBatch],
    local_means: list[dict[str, torch.Tensor]],
    flops_per_token: float,
    counter: OpCounter | None = None,
) -> dict[str, float]:
    """The metric path alone: the same records with fixed values, then one log event (deterministic, comparable)."""
    with maybe(counter, "metrics"):
        for micro_batch, means in zip(micro_batches, local_means):
            record_micro_batch(metrics, means, micro_batch, flops_per_token)
        record_step(metrics, torch.tensor(1.25), 1e-3, 0.5, 100.0)
        return metrics.log()


# ------------------------------------------------------------------------------------------------------- helpers


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, tiny)."""
    scale = b.abs().max().clamp(min=1e-30)
    return float((a - b).abs().max() / scale)


def check_against_reference(
    grad: torch.Tensor,
    losses: Mapping[str, float],
    ref_grad: torch.Tensor,
    ref_losses: Mapping[str, float],
    heads: tuple[str, ...],
) -> dict[str, Any]:
    """A strategy's gradient and its world-mean step loss over `heads` against veomni_lite's ("c")."""
    loss, ref = sum(losses[h] for h in heads), sum(ref_losses[h] for h in heads)
    return {
        "heads": list(heads),
        "grad_max_rel_diff": relative_difference(grad, ref_grad),
        "loss": loss,
        "loss_rel_diff": abs(loss - ref) / max(abs(ref), 1e-30),
    }


def assert_within(checks: Mapping[str, Mapping[str, Any]], grad_tol: float, what: str) -> None:
    """AssertionError naming the strategy when a compared gradient or loss is beyond the tolerances."""
    for key, check in checks.items():
        if "grad_max_rel_diff" not in check:
            continue
        if check["grad_max_rel_diff"] > grad_tol or check["loss_rel_diff"] > TOLERANCES["loss"]:
            raise AssertionError(f"strategy {key} differs from veomni_lite ({what}): {check}")


def world_sum(value: torch.Tensor) -> float:
    buffer = value.detach().double().reshape(1).clone()
    dist.all_reduce(buffer)
    return float(buffer[0])


def choose_reps(rep_seconds: float, budget_s: float, min_reps: int, max_reps: int) -> int:
    """Timed repetitions that fit `budget_s`, clamped; `rep_seconds` is the same on every rank (max-reduced)."""
    if rep_seconds <= 0:
        return max_reps
    return max(min_reps, min(max_reps, int(budget_s / rep_seconds)))


class Settings:
    """Budgets and repetition bounds (seconds per config, min/max timed repetitions) for one mode."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.vlm_budget_s: float = args.vlm_budget_s
        self.path_budget_s: float = args.path_budget_s
        self.min_reps: int = args.min_reps
        self.max_reps: int = args.max_reps


def time_strategies(
    steps: Mapping[str, Callable[[int], Any]], budget_s: float, settings: Settings, max_reps: int | None = None
) -> tuple[dict[str, list[float]], int]:
    """One untimed warm-up repetition (it sizes the repetition count), then the timed interleaved repetitions."""
    warm = interleaved_times(steps, reps=1)
    rep_seconds = sum(values[0] for values in warm.values())
    reps = choose_reps(rep_seconds, budget_s, settings.min_reps, max_reps or settings.max_reps)
    return interleaved_times(steps, reps=reps, rotate_offset=1), reps


def make_record(
    bench: str,
    kind: str,
    layout: dict[str, int],
    strategy_key: str,
    label: str,
    times: list[float],
    counts: dict[str, Any],
    check: dict[str, Any],
) -> dict[str, Any]:
    return {
        "bench": bench,
        "kind": kind,
        **layout,
        "strategy": strategy_key,
        "label": label,
        "times_s": times,
        "reps": len(times),
        **{f"{name}_s": value for name, value in summarize(times).items()},
        "counts": counts,
        "check": check,
    }


# --------------------------------------------------------------------------------------------------- benchmarks


def bench_loss(
    layout: dict[str, int],
    model: TinyVLM,
    optimizer: torch.optim.Optimizer,
    data: list[list[MicroBatch]],
    settings: Settings,
    counter: OpCounter,
) -> list[dict[str, Any]]:
    """VLM-step and loss-path-alone timings of every loss strategy at one (world, sp, ga).

    Equal correctness against veomni_lite ("c"): every head for the full schemes; a strategy with `global_heads`
    (the HF Trainer's) on those heads only, from an extra check step that backpropagates only them; the oracle's
    path alone is a floor without scaling and is not compared.
    """
    world = layout["world"]
    strategies = {cls.key: cls() for cls in LOSS_STRATEGIES}
    records: list[dict[str, Any]] = []

    def vlm_check(strategy: LossStrategy, heads: tuple[str, ...], count: bool) -> tuple[dict[str, float], Any]:
        reset_loss_memo()
        counter.reset()
        with counter.active() if count else contextlib.nullcontext():
            parts, flat = vlm_loss_step(strategy, model, None, data[0], world, counter, heads=heads)
        optimizer.zero_grad(set_to_none=True)
        return {k: world_sum(v) / world for k, v in head_totals(parts).items()}, flat.clone()

    # ---- VLM optimizer step: counting + equality round (no optimizer update), then interleaved timing
    counts, checks = {}, {}
    ref_losses, ref_grad = vlm_check(strategies["c"], LOSS_KEYS, count=False)
    partial: dict[tuple[str, ...], tuple[dict[str, float], torch.Tensor]] = {}
    for key, strategy in strategies.items():
        step_losses, flat = vlm_check(strategy, LOSS_KEYS, count=True)
        counts[key] = counter.snapshot(steps=1)
        heads = getattr(strategy, "global_heads", LOSS_KEYS)
        if heads == LOSS_KEYS:
            checks[key] = check_against_reference(flat, step_losses, ref_grad, ref_losses, heads)
            continue
        if heads not in partial:
            partial[heads] = vlm_check(strategies["c"], heads, count=False)
        step_losses, flat = vlm_check(strategy, heads, count=False)
        checks[key] = check_against_reference(flat, step_losses, partial[heads][1], partial[heads][0], heads)
        checks[key]["not_global"] = [h for h in LOSS_KEYS if h not in heads]
    assert_within(checks, TOLERANCES["vlm_grad"], f"VLM step at {layout}")
    vlm_loss_step(strategies["c"], model, optimizer, data[0], world)  # AdamW state exists before timing

    def vlm_step(strategy: LossStrategy) -> Callable[[int], Any]:
        return lambda rep: vlm_loss_step(strategy, model, optimizer, data[rep % len(data)], world)

    times, _ = time_strategies({k: vlm_step(s) for k, s in strategies.items()}, settings.vlm_budget_s, settings)
    for key, strategy in strategies.items():
        records.append(make_record("loss", "vlm", layout, key, strategy.label, times[key], counts[key], checks[key]))

    # ---- loss path alone
    weights = {key: torch.nn.Parameter(torch.ones(())) for key in LOSS_KEYS}
    means = [fixed_local_means(step, seed=1000 * dist.get_rank() + i) for i, step in enumerate(data)]
    counts, losses, grads = {}, {}, {}
    for key, strategy in strategies.items():
        reset_loss_memo()
        counter.reset()
        with counter.active():
            step_losses = head_totals(path_loss_step(strategy, weights, data[0], means[0], counter))
        counts[key] = counter.snapshot(steps=1)
        grad = torch.stack([weights[k].grad.double() for k in LOSS_KEYS])
        dist.all_reduce(grad)
        losses[key] = {k: world_sum(v) / world for k, v in step_losses.items()}
        grads[key] = dict(zip(LOSS_KEYS, grad.unbind()))
        for weight in weights.values():
            weight.grad = None
    checks = {}
    for key, strategy in strategies.items():
        if isinstance(strategy, Oracle):
            checks[key] = {"heads": [], "not_compared": "the floor: one bare all-reduce, no scaling"}
            continue
        heads = getattr(strategy, "global_heads", LOSS_KEYS)
        grad, ref_grad = (torch.stack([g[h] for h in heads]) for g in (grads[key], grads["c"]))
        checks[key] = check_against_reference(grad, losses[key], ref_grad, losses["c"], heads)
        if heads != LOSS_KEYS:
            checks[key]["not_global"] = [h for h in LOSS_KEYS if h not in heads]
    assert_within(checks, TOLERANCES["path_grad"], f"loss path at {layout}")

    steps = {key: path_runner(strategy, weights, data, means) for key, strategy in strategies.items()}
    times, _ = time_strategies(steps, settings.path_budget_s, settings)
    for key, strategy in strategies.items():
        records.append(make_record("loss", "path", layout, key, strategy.label, times[key], counts[key], checks[key]))
    return records


def bench_metrics(
    layout: dict[str, int],
    model: TinyVLM,
    optimizer: torch.optim.Optimizer,
    data: list[list[MicroBatch]],
    settings: Settings,
    counter: OpCounter,
    sp_rank: int,
) -> list[dict[str, Any]]:
    """VLM-step and metric-path-alone timings of the two metric strategies (log every step) at one layout."""
    world = layout["world"]
    flops_per_token = model.flops_per_token(data[0][0]["input_ids"].shape[1] * layout["sp"])
    strategies = {cls.key: cls(METRIC_SPECS, sp_rank=sp_rank) for cls in METRIC_STRATEGIES}
    means = [fixed_local_means(step, seed=1000 * dist.get_rank() + i) for i, step in enumerate(data)]
    records: list[dict[str, Any]] = []

    # equality and counts on the deterministic path, then on the VLM step (counts only: values include timings)
    path_counts, logged = {}, {}
    for key, metrics in strategies.items():
        counter.reset()
        with counter.active():
            logged[key] = path_metrics_step(metrics, data[0], means[0], flops_per_token, counter)
        path_counts[key] = counter.snapshot(steps=1)
    reference = logged["b"]
    for key, values in logged.items():
        if sorted(values) != sorted(reference) or any(
            not math.isclose(values[name], reference[name], rel_tol=TOLERANCES["metrics"], abs_tol=1e-12)
            for name in reference
        ):
            raise AssertionError(f"metric strategy {key} logs {values}, veomni_lite logs {reference} at {layout}")
    check = {"logged_keys": len(reference), "equal": True}

    vlm_counts = {}
    for key, metrics in strategies.items():
        reset_loss_memo()
        counter.reset()
        with counter.active():
            vlm_metrics_step(metrics, model, optimizer, data[0], world, flops_per_token, counter)
        vlm_counts[key] = counter.snapshot(steps=1)

    def vlm_step(metrics: MetricStrategy) -> Callable[[int], Any]:
        return lambda rep: vlm_metrics_step(metrics, model, optimizer, data[rep % len(data)], world, flops_per_token)

    def path_step(metrics: MetricStrategy) -> Callable[[int], Any]:
        return lambda rep: path_metrics_step(metrics, data[rep % len(data)], means[rep % len(data)], flops_per_token)

    times, _ = time_strategies({k: vlm_step(m) for k, m in strategies.items()}, settings.vlm_budget_s, settings)
    for key, metrics in strategies.items():
        records.append(make_record("metrics", "vlm", layout, key, metrics.label, times[key], vlm_counts[key], check))
    times, _ = time_strategies({k: path_step(m) for k, m in strategies.items()}, settings.path_budget_s, settings)
    for key, metrics in strategies.items():
        records.append(make_record("metrics", "path", layout, key, metrics.label, times[key], path_counts[key], check))
    return records


def long_run_rss(data: list[list[MicroBatch]], steps: int, log_interval: int, sp_rank: int) -> dict[str, Any]:
    """veomni_lite's loss path and metric recording for `steps` steps: RSS samples, peak RSS, memo/window sizes."""
    strategy = VeOmniLite()
    metrics = LogTimeMetrics(METRIC_SPECS, sp_rank=sp_rank)
    weights = {key: torch.nn.Parameter(torch.ones(())) for key in LOSS_KEYS}
    means = [fixed_local_means(step, seed=7 + i) for i, step in enumerate(data)]
    samples: list[tuple[int, int]] = []
    max_window_slots = 0
    sample_every = max(1, steps // 10)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        micro_batches = data[step % len(data)]
        step_loss = sum(head_totals(path_loss_step(strategy, weights, micro_batches, means[step % len(data)])).values())
        for micro_batch, mean in zip(micro_batches, means[step % len(data)]):
            record_micro_batch(metrics, mean, micro_batch, 1.0e6)
        record_step(metrics, step_loss, 1e-3, 0.01, 1.0)
        max_window_slots = max(max_window_slots, len(metrics.accumulator._window.slots))
        if step % log_interval == 0:
            metrics.log()
        for weight in weights.values():
            weight.grad = None
        if step % sample_every == 0 or step == 1:
            samples.append((step, rss_kib()))
    memo = getattr(loss_utils, "_MEMO", None)
    return {
        "steps": steps,
        "grad_accum": len(data[0]),
        "log_interval": log_interval,
        "seconds": time.perf_counter() - start,
        "rss_kib_samples": samples,
        "rss_growth_kib_after_first_tenth": samples[-1][1] - samples[1][1] if len(samples) > 1 else 0,
        "peak_rss_kib": peak_rss_kib(),
        "memo_steps_held": 0 if memo is None else 1,
        "max_metric_window_slots": max_window_slots,
        "metric_specs": len(METRIC_SPECS),
    }


def probe_all_reduce(reps: int, elements: int) -> dict[str, dict[str, float]]:
    """Latency of one int64 all-reduce over the world: 1 element (a count) vs `elements` (what veomni_lite's loss
    path sent per all-reduce in the counting round)."""
    sizes = {"1 element": 1}
    if elements != 1:
        sizes[f"{elements} elements (veomni_lite's loss-path all-reduce, as counted)"] = elements
    steps = {name: (lambda rep, n=n: dist.all_reduce(torch.zeros(n, dtype=torch.int64))) for name, n in sizes.items()}
    interleaved_times(steps, reps=10)
    return {name: summarize(times) for name, times in interleaved_times(steps, reps=reps).items()}


def counted_elements(records: list[dict[str, Any]]) -> int:
    """Elements per all-reduce of veomni_lite's loss path alone, from the counting round (the same on every rank)."""
    for record in records:
        if (record["bench"], record["kind"], record["strategy"]) == ("loss", "path", "c"):
            calls = record["counts"]["collectives"].get("step", 0.0)
            return round(record["counts"]["elements"].get("step", 0.0) / calls) if calls else 1
    return 1


# ---------------------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--ga", default="1,4,8,16,32", help="comma-separated gradient-accumulation values")
    parser.add_argument("--sp", default="1,2", help="comma-separated sequence-parallel sizes")
    parser.add_argument("--metrics-sp", default="1", help="SP sizes for the metric benchmark (SP does not change it)")
    parser.add_argument("--vlm-budget-s", type=float, default=6.0, help="timed seconds per VLM config (all strategies)")
    parser.add_argument("--path-budget-s", type=float, default=2.0, help="timed seconds per path-alone config")
    parser.add_argument("--min-reps", type=int, default=5)
    parser.add_argument("--max-reps", type=int, default=30)
    parser.add_argument("--trainer-ga", default="1,8", help="GA values of the trainer-vs-bare benchmark ('': skip)")
    parser.add_argument("--trainer-budget-s", type=float, default=10.0, help="timed seconds per trainer GA (both)")
    parser.add_argument("--trainer-log-interval", type=int, default=10, help="the benchmarked trainer's log_interval")
    parser.add_argument("--rss-steps", type=int, default=0, help="long-run RSS steps (0: skip)")
    parser.add_argument("--rss-ga", type=int, default=4)
    parser.add_argument("--probe-reps", type=int, default=200, help="all-reduce latency probe repetitions (0: skip)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    world, rank = dist.get_world_size(), dist.get_rank()
    settings = Settings(args)
    counter = OpCounter()
    dataset = vlm_dataset()
    ga_values = [int(v) for v in args.ga.split(",") if v]
    metrics_sp = {int(v) for v in args.metrics_sp.split(",") if v}
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for sp in (int(v) for v in args.sp.split(",") if v):
        if world % sp:
            continue
        state = init_parallel_state(world // sp, sp)
        model = build_model(dataset.vocab_size, dataset.num_image_codes, dataset.image_token_id, sp, state.sp_group)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for ga in ga_values:
            layout = {"world": world, "dp": state.dp_size, "sp": sp, "ga": ga}
            data = make_steps(
                dataset, MICRO_BATCH_SIZE, ga, state.dp_size, state.dp_rank, sp, state.sp_rank, DATA_STEPS
            )
            config_start = time.perf_counter()
            records += bench_loss(layout, model, optimizer, data, settings, counter)
            if sp in metrics_sp:
                records += bench_metrics(layout, model, optimizer, data, settings, counter, state.sp_rank)
            if rank == 0:
                print(f"[bench] world {world} sp {sp} ga {ga}: {time.perf_counter() - config_start:.1f}s", flush=True)
        reset_loss_memo()
        destroy_parallel_state()

    trainer_ga = [int(v) for v in args.trainer_ga.split(",") if v]
    if trainer_ga:
        trainer_start = time.perf_counter()
        data_by_ga = {ga: make_steps(dataset, MICRO_BATCH_SIZE, ga, world, rank, 1, 0, DATA_STEPS) for ga in trainer_ga}
        records += bench_trainer(
            world,
            data_by_ga,
            MICRO_BATCH_SIZE,
            args.trainer_log_interval,
            lambda seconds: choose_reps(seconds, args.trainer_budget_s, settings.min_reps, settings.max_reps),
            counter,
        )
        if rank == 0:
            print(f"[bench] world {world} trainer vs bare: {time.perf_counter() - trainer_start:.1f}s", flush=True)
    probe = probe_all_reduce(args.probe_reps, counted_elements(records)) if args.probe_reps else None
    rss = None
    if args.rss_steps:
        state = init_parallel_state(world, 1)
        data = make_steps(dataset, MICRO_BATCH_SIZE, args.rss_ga, world, state.dp_rank, 1, 0, 4)
        rss = long_run_rss(data, args.rss_steps, log_interval=10, sp_rank=0)
        rss["world"] = world
        rss["peak_rss_kib_all_ranks"] = agree_max(float(rss["peak_rss_kib"]))
        destroy_parallel_state()

    if rank == 0:
        out = {
            "world": world,
            "micro_batch_size": MICRO_BATCH_SIZE,
            "loss_keys": list(LOSS_KEYS),
            "metric_names": [spec.name for spec in METRIC_SPECS],
            "model": MODEL_DIMS,
            "tolerances": TOLERANCES,
            "machine": machine_description(),
            "seconds": time.perf_counter() - started,
            "records": records,
            "rss": rss,
            "all_reduce_latency": probe,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
