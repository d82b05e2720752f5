"""What the trainer logs, and when: the bridge between the train loop and `veomni_lite.metrics`.

Per micro-batch (local, no collective, no host read): each loss key's local mean weighted by its local valid tokens,
tokens and samples seen, model FLOPs. Per step (local): grad norm, lr, step time, skipped steps, peak memory.
At a log step the open window is handed to the `StepEndWorker`, which reduces it (one SUM + one MAX all-reduce on a
dedicated gloo group, so it never interleaves with training collectives) and writes the sinks while the next step
computes; the next optimizer update waits for it. Hence a console line for step s may print after the progress bar
has moved past s; metrics.jsonl and TensorBoard are always in step order.

Derived at log time: `train/loss` (the sum of the per-key global token means: the optimizer's objective),
`train/tokens_per_s`, `train/tokens_seen` (cumulative), `train/tflops` and, where the accelerator's peak is known,
`train/mfu`. Tokens are counted on each rank's own sequence shard, so SP does not count them twice; samples are
counted once per sp group.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from veomni_lite.metrics import MetricReporter, MetricSpec, StepEndError, StepEndWorker, new_metrics_group

if TYPE_CHECKING:
    from veomni_lite.trainer.base import BaseTrainer

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


def _drop(_batches: Any) -> None:
    """Runs on the worker: the last reference to the step's batches goes away here."""


class TrainMetrics:
    """Owns the reporter and the step-end worker for one trainer."""

    def __init__(self, trainer: BaseTrainer) -> None:
        train = trainer.config.train
        self.trainer = trainer
        self.loss_names = list(trainer.loss_keys)
        specs = [MetricSpec(name, "mean") for name in self.loss_names] + [
            MetricSpec("grad_norm", "mean"),
            MetricSpec("lr", "last", fmt=".1e"),
            MetricSpec("step_time_s", "mean", fmt=".3f"),
            MetricSpec("tokens", "sum", fmt=",.0f"),
            MetricSpec("samples", "sum", fmt=",.0f", sp_dedup=True),
            MetricSpec("flops", "sum", fmt=".3e"),
            MetricSpec("skipped_steps", "sum", fmt=".0f"),
            MetricSpec("peak_mem_mb", "max", fmt=".1f"),
        ]
        eval_specs = [MetricSpec(name, "sum") for name in ("loss", *self.loss_names)]
        console_write = None
        if trainer.is_main and train.progress_bar:
            from tqdm.auto import tqdm

            console_write = tqdm.write  # keeps the progress bar intact
        self.reporter = MetricReporter(
            specs,
            trainer.output_dir,
            log_interval=train.log_interval,
            max_steps=train.max_steps,
            is_main_rank=trainer.is_main,
            eval_specs=eval_specs,
            tensorboard=train.tensorboard,
            loss_curve=train.plot,
            plot_keys=["train/loss", *(f"train/{name}" for name in self.loss_names), "eval/loss"],
            console_write=console_write,
            group=new_metrics_group(),
            sp_rank=trainer.parallel.sp_rank,
            extra_formats={
                "train/loss": ".4f",
                "train/tokens_per_s": ",.0f",
                "train/tokens_seen": ",.0f",
                "train/tflops": ".4f",
            },
        )
        self.worker = StepEndWorker(enabled=train.async_step_end)
        self.peak_flops = peak_flops(trainer.device, train.peak_tflops)
        self.world_size = trainer.parallel.world_size
        self.last_logged: dict[str, Any] = {}
        self.tokens_seen = 0.0  # cumulative over the run (restored on resume)
        self._window_start = time.perf_counter()
        self._closed = False

    # ---------------------------------------------------------------- recording (local)

    def record_micro_batch(
        self,
        outputs: Mapping[str, torch.Tensor],
        micro_batch_token_len: Mapping[str, torch.Tensor],
        micro_batch: Mapping[str, torch.Tensor],
    ) -> None:
        for key in self.loss_names:
            tokens = micro_batch_token_len[key[: -len("_loss")] + "_tokens"].to(outputs[key].device, non_blocking=True)
            local_mean = torch.where(tokens > 0, outputs[key].detach(), torch.zeros_like(outputs[key]))
            self.reporter.record(key, local_mean.float(), count=tokens)
        input_ids = micro_batch["input_ids"]
        seen = (input_ids != self.trainer.pad_id).sum()
        self.reporter.record("tokens", seen)
        self.reporter.record("samples", float(input_ids.shape[0]))
        full_seq_len = input_ids.shape[1] * self.trainer.parallel.sp_size
        self.reporter.record("flops", seen.double() * self.trainer.flops_per_token(full_seq_len))

    def record_step(self, grad_norm: torch.Tensor, skipped: bool, step_time: float) -> None:
        self.reporter.record("grad_norm", grad_norm.float())
        self.reporter.record("lr", self.trainer.scheduler.get_last_lr()[0])
        self.reporter.record("step_time_s", step_time)
        if self.trainer.is_main:
            self.reporter.record("skipped_steps", float(skipped))
        self.reporter.record("peak_mem_mb", peak_memory_mb(self.trainer.device))

    # ---------------------------------------------------------------- log events

    def _derive(self, window_seconds: float) -> Any:
        def derive(reduced: Mapping[str, float]) -> dict[str, float]:
            out: dict[str, float] = {}
            losses = [reduced[name] for name in self.loss_names if name in reduced]
            if losses:
                out["loss"] = sum(losses)
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
        self.worker.submit(self._log_task, step, epoch, self.reporter.take_window(), window_seconds)

    def wait_bookkeeping(self) -> None:
        self.worker.wait()

    def log_eval(self, step: int, epoch: int, scaled_totals: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """`scaled_totals`: per loss key, this rank's summed `mean_global_loss` outputs (sum over ranks / W = mean)."""
        self.worker.wait()  # eval reduces on the metrics group too: never concurrently with a log task
        total = torch.zeros(())
        for key, value in scaled_totals.items():
            contribution = value.detach().float().cpu() / self.world_size
            self.reporter.record_eval(key, contribution)
            total = total + contribution
        self.reporter.record_eval("loss", total)
        return self.reporter.log_eval(max(step, 1), epoch)

    def postfix(self) -> str:
        values = self.last_logged
        parts = [f"{key.split('/')[-1]}={values[key]:.4f}" for key in ("train/loss",) if key in values]
        return " ".join(parts)

    def finish(self) -> dict[str, Any]:
        """Collective: log whatever the window still holds at the current step, drain the worker, flush sinks."""
        self.worker.wait()
        if self.trainer.step > 0 and not self.reporter.train.is_empty:
            self.end_step(self.trainer.step, self.trainer.loader.epoch, force=True)
        self.worker.wait()
        self.reporter.flush()
        return self.last_logged

    def abort(self) -> None:
        """Exception path (no collectives): stop the worker without masking the original error, flush the sinks."""
        try:
            self.worker.close()
        except StepEndError as exc:
            print(f"[veomni_lite] step-end bookkeeping also failed: {exc.__cause__!r}", file=sys.stderr)
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

    def state_dict(self) -> dict[str, Any]:
        """What every rank shares: the series and the cumulative token count."""
        return {"series": self.reporter.series.state_dict(), "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: Mapping[str, Any], step: int) -> None:
        self.reporter.series.load_state_dict(state["series"])
        self.tokens_seen = state.get("tokens_seen", 0.0)
        self.reporter.resume(step)

    def window_state_dict(self) -> dict[str, Any]:
        """This rank's open windows."""
        return {"train": self.reporter.train.state_dict(), "eval": self.reporter.eval.state_dict()}

    def load_window_state_dict(self, state: Mapping[str, Any]) -> None:
        self.reporter.train.load_state_dict(state["train"])
        self.reporter.eval.load_state_dict(state["eval"])
