"""What the trainer logs, and when: the bridge between the train loop and `veomni_lite.metrics`.

Kept per micro-batch and recorded once per step (local, no collective, no host read): each loss key's local mean
weighted by its local valid tokens, tokens and samples seen, model FLOPs. Per step (local): grad norm, the lr the
step trained with, the step's own time, the time it waited for the previous step's bookkeeping, skipped steps, peak
memory. Each value is labelled with the step that produced it; a step that does not finish records nothing.
At a log step the open window is handed to the `StepEndWorker`, which reduces it (one SUM + one MAX all-reduce on a
dedicated gloo group, so it never interleaves with training collectives) and writes the sinks while the next step
computes; the next optimizer update waits for it. Hence a console line for step s may print after the progress bar
has moved past s; metrics.jsonl and TensorBoard are always in step order.

Windows and checkpoints. A checkpoint never holds an open window: `checkpoint_state()` first logs the open window
(an extra row when a save step is not a log step), so metrics.jsonl covers every step the checkpoint trained, and a
resumed run starts with an empty window. The checkpoint holds no metric history: metrics.jsonl is it, read back (up
to the checkpoint's step) on resume, so a checkpoint's size does not grow with the run. Each window is therefore
logged exactly once whatever the moment of an interrupt: steps after the newest checkpoint are retrained (and
logged) by a resume, rows after it are truncated. `finish()` logs the open window on agreed exits; `abort()`
(unexpected exception, no collective possible) warns which steps were not logged: a resume retrains them from the
newest checkpoint, which precedes them, and logs them then.

Each `train/<name>_loss` is the value its loss mode trains on: at log_interval 1 the step's normalized value, over
a longer window the steps' numerators over their denominators (token-sum: the mean of the steps' sums).
Derived at log time: `train/loss` (the sum of the per-key values: the optimizer's objective),
`train/tokens_per_s`, `train/tokens_seen` (cumulative), `train/padding_ratio` (padding positions / all positions run
in the window), `train/tflops` and, where the accelerator's peak is known, `train/mfu`. Tokens are the samples' own
(`sequence_ids` >= 0; a token budget's padding micro-batches add none), so `tokens_per_s` is real-token throughput
with or without packing. They are counted on each rank's own sequence shard, so SP does not count them twice;
samples are counted once per sp group.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, SEQUENCE_IDS, name_of_loss, tokens_key
from veomni_lite.metrics import MetricReporter, MetricSpec, StepEndError, StepEndWorker, new_metrics_group
from veomni_lite.utils.loss_utils import LossModes

logger = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s by CUDA device name fragment, for the MFU estimate.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> float | None:
    """The accelerator's peak FLOP/s: configured, else looked up for CUDA; None when unknown (e.g. CPU)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((flops for key, flops in _PEAK_FLOPS.items() if key in name), None)
    return None


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated device memory (CUDA) or the process's peak RSS (CPU), in MiB. Host-only calls."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def train_metric_specs(loss_names: list[str]) -> list[MetricSpec]:
    """The metrics a train step records, in display order (loss keys first)."""
    return [MetricSpec(name, "mean") for name in loss_names] + [
        MetricSpec("grad_norm", "mean"),
        MetricSpec("lr", "last", fmt=".1e"),
        MetricSpec("step_time_s", "mean", fmt=".3f"),
        MetricSpec("bookkeeping_wait_s", "mean", fmt=".4f"),
        MetricSpec("tokens", "sum", fmt=",.0f"),
        MetricSpec("positions", "sum", fmt=",.0f"),
        MetricSpec("samples", "sum", fmt=",.0f", sp_dedup=True),
        MetricSpec("flops", "sum", fmt=".3e"),
        MetricSpec("skipped_steps", "sum", fmt=".0f"),
        MetricSpec("peak_mem_mb", "max", fmt=".1f"),
    ]


@dataclass
class _StepRecords:
    """What the current step's micro-batches handed to `record_micro_batch`."""

    loss_means: list[torch.Tensor] = field(default_factory=list)  # per micro-batch, then per loss key
    loss_counts: list[torch.Tensor] = field(default_factory=list)  # their valid-token counts, in the same order
    loss_weights: list[torch.Tensor] = field(default_factory=list)  # the counts of their modes' denominators
    seen: list[torch.Tensor] = field(default_factory=list)  # real (sample) tokens per micro-batch
    positions: int = 0  # every position the micro-batches ran, padding included
    flops_per_token: list[float] = field(default_factory=list)
    samples: int = 0


def _drop(_batches: Any) -> None:
    """Runs on the worker: the last reference to the step's batches goes away here."""


class TrainMetrics:
    """Owns the reporter and the step-end worker of one training run; its inputs are explicit (no trainer object).

    `flops_per_token(full_seq_len)` gives the model FLOPs per token; `pad_id` marks padding in `input_ids`.
    """

    def __init__(
        self,
        *,
        loss_names: list[str],
        loss_modes: LossModes | None = None,
        output_dir: str | Path,
        log_interval: int,
        max_steps: int,
        is_main: bool,
        device: torch.device,
        world_size: int,
        sp_rank: int,
        sp_size: int,
        pad_id: int,
        flops_per_token: Callable[[int], float],
        progress_bar: bool = False,
        tensorboard: bool = True,
        plot: bool = True,
        wandb_project: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        async_step_end: bool = True,
        peak_tflops: float = 0.0,
    ) -> None:
        self.loss_names = list(loss_names)
        modes = LossModes.of(loss_modes)
        # (loss key, its tokens key, the count of its mode's denominator or None for token-sum, that count's factor)
        self._loss_count_keys = [
            (key, tokens_key(name), modes.count_key(name), modes.constant(name))
            for key, name in ((key, name_of_loss(key)) for key in self.loss_names)
        ]
        self._step = _StepRecords()  # this step's micro-batch records, until `record_step`
        self.is_main = is_main
        self.device = device
        self.world_size = world_size
        self.sp_size = sp_size
        self.pad_id = pad_id
        self.flops_per_token = flops_per_token
        eval_specs = [MetricSpec(name, "sum") for name in ("loss", *self.loss_names)]
        console_write = None
        if is_main and progress_bar:
            from tqdm.auto import tqdm

            console_write = tqdm.write  # keeps the progress bar intact
        self.reporter = MetricReporter(
            train_metric_specs(self.loss_names),
            output_dir,
            log_interval=log_interval,
            max_steps=max_steps,
            is_main_rank=is_main,
            eval_specs=eval_specs,
            tensorboard=tensorboard,
            loss_curve=plot,
            wandb_project=wandb_project,
            run_config=run_config,
            plot_keys=["train/loss", *(f"train/{name}" for name in self.loss_names), "eval/loss"],
            console_write=console_write,
            group=new_metrics_group(),
            sp_rank=sp_rank,
            extra_formats={
                "train/loss": ".4f",
                "train/tokens_per_s": ",.0f",
                "train/padding_ratio": ".3f",
                "train/tokens_seen": ",.0f",
                "train/tflops": ".4f",
            },
        )
        self.worker = StepEndWorker(enabled=async_step_end)
        self.peak_flops = peak_flops(device, peak_tflops)
        self.last_logged: dict[str, Any] = {}
        self.tokens_seen = 0.0  # cumulative over the run (restored on resume)
        self.last_logged_step = 0  # the newest step whose window was handed to a log task
        self.window_steps = 0  # steps recorded in the open window (host-side)
        self._window_start = time.perf_counter()
        self._closed = False

    # ---------------------------------------------------------------- recording (local)

    def record_micro_batch(
        self,
        outputs: Mapping[str, torch.Tensor],
        micro_batch_token_len: Mapping[str, torch.Tensor],
        micro_batch: Mapping[str, torch.Tensor],
    ) -> None:
        """Keep this micro-batch's loss means, their token counts and the tokens it saw; `record_step` records the
        step's sums, so a micro-batch costs two ops whatever the number of metrics."""
        step = self._step
        for key, token_key, weight_key, _ in self._loss_count_keys:
            step.loss_means.append(outputs[key].detach())
            step.loss_counts.append(micro_batch_token_len[token_key])
            step.loss_weights.append(micro_batch_token_len[weight_key or token_key])
        input_ids = micro_batch["input_ids"]
        step.positions += input_ids.numel()
        step.flops_per_token.append(self.flops_per_token(input_ids.shape[1] * self.sp_size))
        if bool(micro_batch.get("padding_flag", False)):  # a token budget's no-target micro-batch (host tensor)
            step.seen.append(torch.zeros((), dtype=torch.long))
            return
        ids = micro_batch.get(SEQUENCE_IDS)
        step.seen.append((ids >= 0).sum() if ids is not None else (input_ids != self.pad_id).sum())
        whole = micro_batch.get(ATTENTION_SEQUENCE_IDS)  # a packed row: its samples, whole under SP
        step.samples += int(whole.max()) + 1 if whole is not None else input_ids.shape[0]

    def _record_micro_batches(self) -> None:
        """The kept micro-batches' sums into the window: per loss key sum(local mean x tokens) (a shard without tokens
        adds exactly 0, its NaN mean included) over its mode's denominator (its local count, so the ranks' counts add
        up to the step's D; token-sum: 1 / W per rank, so a window averages its steps), tokens seen, samples, FLOPs."""
        step, self._step = self._step, _StepRecords()
        if not step.seen:
            return
        if self.loss_names:
            means = torch.stack(step.loss_means).view(-1, len(self.loss_names)).double()
            counts = torch.stack(step.loss_counts).view(-1, len(self.loss_names)).to(means.device, non_blocking=True)
            weighted = torch.where(counts > 0, means, 0.0) * counts
            weights = torch.stack(step.loss_weights).view(-1, len(self.loss_names)).sum(0).double()
            for (key, _, weight_key, factor), total, weight in zip(
                self._loss_count_keys, weighted.sum(0).unbind(), weights.unbind()
            ):
                self.reporter.record_total(key, total, weight * factor if weight_key else 1.0 / self.world_size)
        seen = torch.stack(step.seen)
        self.reporter.record("tokens", seen.sum())
        self.reporter.record("samples", float(step.samples))
        self.reporter.record("positions", float(step.positions))
        flops_per_token = torch.tensor(step.flops_per_token, dtype=torch.float64, device=seen.device)
        self.reporter.record("flops", seen.double() @ flops_per_token)

    def record_step(
        self, grad_norm: torch.Tensor, *, lr: float, skipped: bool, step_time: float, bookkeeping_wait: float
    ) -> None:
        """One optimizer step's values: `lr` is the rate the step trained with; `skipped` is agreed by every rank.
        The step's micro-batch records go into the window here, with them."""
        self._record_micro_batches()
        self.reporter.record("grad_norm", grad_norm.float())
        self.reporter.record("lr", lr)
        self.reporter.record("step_time_s", step_time)
        self.reporter.record("bookkeeping_wait_s", bookkeeping_wait)
        if self.is_main:  # the decision is the same on every rank: count it once
            self.reporter.record("skipped_steps", float(skipped))
        self.reporter.record("peak_mem_mb", peak_memory_mb(self.device))
        self.window_steps += 1

    # ---------------------------------------------------------------- log events

    def _derive(self, window_seconds: float) -> Any:
        def derive(reduced: Mapping[str, float]) -> dict[str, float]:
            out: dict[str, float] = {}
            losses = [reduced[name] for name in self.loss_names if name in reduced]
            if losses:
                out["loss"] = sum(losses)
            if "tokens" in reduced and reduced.get("positions"):
                out["padding_ratio"] = 1.0 - reduced["tokens"] / reduced["positions"]
            if "tokens" in reduced:
                self.tokens_seen += reduced["tokens"]
                out["tokens_seen"] = self.tokens_seen
                if window_seconds > 0:
                    out["tokens_per_s"] = reduced["tokens"] / window_seconds
            if "flops" in reduced and window_seconds > 0:
                achieved = reduced["flops"] / window_seconds
                out["tflops"] = achieved / 1e12
                if self.peak_flops:
                    out["mfu"] = achieved / (self.peak_flops * self.world_size)
            return out

        return derive

    def _log_task(self, step: int, epoch: int, window: Any, window_seconds: float) -> None:
        values = self.reporter.log(step, epoch, window=window, derive=self._derive(window_seconds))
        if values:
            self.last_logged = values

    def end_step(self, step: int, epoch: int, force: bool = False, release: Any = None) -> None:
        """Hand the window to the worker at log steps (always at the final step, or when forced).

        `release` (the step's batches) is dropped on the worker, so freeing it is off the critical path too.
        """
        if release is not None:
            self.worker.submit(_drop, release)
        if not (force or self.reporter.should_log(step)):
            return
        now = time.perf_counter()
        window_seconds, self._window_start = now - self._window_start, now
        self.last_logged_step, self.window_steps = step, 0
        self.worker.submit(self._log_task, step, epoch, self.reporter.take_window(), window_seconds)

    def wait_bookkeeping(self) -> None:
        self.worker.wait()

    def log_eval(
        self,
        step: int,
        epoch: int,
        scaled_totals: Mapping[str, torch.Tensor],
        extra: Mapping[str, float] | None = None,
    ) -> dict[str, Any]:
        """`scaled_totals`: per loss key, this rank's summed `mean_global_loss` outputs (sum over ranks / W = mean);
        `extra`: values that are already global (e.g. `caption_accuracy`), logged as they are."""
        self.worker.wait()  # eval reduces on the metrics group too: never concurrently with a log task
        total = torch.zeros(())
        for key, value in scaled_totals.items():
            contribution = value.detach().float().cpu() / self.world_size
            self.reporter.record_eval(key, contribution)
            total = total + contribution
        self.reporter.record_eval("loss", total)
        return self.reporter.log_eval(max(step, 1), epoch, extra)

    def postfix(self) -> str:
        values = self.last_logged
        parts = [f"{key.split('/')[-1]}={values[key]:.4f}" for key in ("train/loss",) if key in values]
        return " ".join(parts)

    def finish(self, step: int, epoch: int) -> dict[str, Any]:
        """Collective: log what the window still holds at `step` (the last trained step, of `epoch`), drain the
        worker, flush the sinks; returns the last logged values. A step that raised on every rank after its
        micro-batches (a non-finite verdict) has its records logged too."""
        self.worker.wait()
        self._record_micro_batches()
        if step > 0 and not self.reporter.train.is_empty:
            self.end_step(step, epoch, force=True)
        self.worker.wait()
        self.reporter.flush()
        return self.last_logged

    def abort(self, step: int) -> None:
        """Exception path (no collective possible): stop the worker without masking the original error, say which
        steps were not logged, flush the sinks."""
        try:
            self.worker.close()
        except StepEndError as exc:
            logger.error("step-end bookkeeping also failed: %r", exc.__cause__)
        if self.window_steps and self.is_main:
            logger.warning(
                "steps %d-%d were trained but not logged (their reduction needs every rank); resuming retrains them "
                "from the newest checkpoint and logs them then",
                step - self.window_steps + 1,
                step,
            )
        self.reporter.train.reset()
        self.window_steps = 0
        self.reporter.close()

    def flush(self) -> None:
        self.reporter.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.worker.close()
        self.reporter.close()

    # ---------------------------------------------------------------- checkpoint state

    def checkpoint_state(self, step: int, epoch: int) -> dict[str, Any]:
        """Collective: log the open window at `step` first, so the checkpoint holds no window, then return what every
        rank shares: the cumulative token count. Its size does not grow with the run: the logged history lives in
        metrics.jsonl, appended at each log, and a resume reads it back from there."""
        self.finish(step, epoch)
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: Mapping[str, Any], step: int) -> None:
        """Continue after the checkpoint at `step`: truncate the sinks' later rows; the main rank's series is read
        back from metrics.jsonl (a checkpoint written before this change carries the series itself)."""
        self.reporter.series.load_state_dict(state.get("series", {}))
        self.tokens_seen = state.get("tokens_seen", 0.0)
        self.last_logged_step = step
        self.reporter.resume(step)
