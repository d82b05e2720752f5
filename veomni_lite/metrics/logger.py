"""`MetricLogger`: what the trainer records, when it is reduced, where it is written.

Recording is local (no collective, no host read): per micro-batch the loss keys' local means and valid tokens and the
tokens seen; per step its grad norm, lr, time, wait for the previous step's bookkeeping, skip and peak memory. At a log
step (every `log_interval`-th, and the last) a worker thread reduces the window (one SUM + one MAX all-reduce on a gloo
group of its own, never interleaved with training collectives), derives `train/loss` (the sum of the loss keys),
`tokens_seen`, `tokens_per_s`, `padding_ratio`, `tflops`, `mfu` (known GPUs) and writes the sinks while the next step
computes. `train/<name>_loss` is what its loss mode trains on: the window's numerators over its denominators (token-sum:
the mean of the steps' sums). Tokens are the samples' own on each rank's shard; samples count once per sp group.

Each window is logged once whatever the interrupt: a checkpoint logs the open window first and holds no history;
metrics.jsonl is the history, read back on resume up to the checkpoint's step (later rows and TensorBoard purged).
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import veomni_lite.metrics.sinks as sinks
from veomni_lite.distributed.parallel_state import ParallelState, get_parallel_state
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, SEQUENCE_IDS, name_of_loss, tokens_key
from veomni_lite.metrics.accumulator import MetricAccumulator, MetricSpec
from veomni_lite.metrics.sinks import Scalar, Series
from veomni_lite.utils.loss_utils import LossModes

if TYPE_CHECKING:
    from veomni_lite.config import LoggingConfig

logger = logging.getLogger(__name__)


def progress_bar_shown(settings: LoggingConfig) -> bool:
    """`logging.progress_bar` where stderr (tqdm's stream) is a terminal. Elsewhere (a log file, a pipe) a bar would
    write the run as a few long carriage-return lines: the console's one line per `log_interval` shows the progress."""
    return settings.progress_bar and sys.stderr.isatty()


# Dense bf16 peak FLOP/s by CUDA device name fragment, for the MFU estimate.
_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}
_FORMATS = {"loss": ".4f", "tokens_per_s": ",.0f", "padding_ratio": ".3f", "tokens_seen": ",.0f", "tflops": ".4f"}


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
    sums = [("tokens", ",.0f"), ("positions", ",.0f"), ("samples", ",.0f"), ("flops", ".3e"), ("skipped_steps", ".0f")]
    return [
        *(MetricSpec(name, "mean") for name in (*loss_names, "grad_norm")),
        MetricSpec("lr", "last", fmt=".1e"),
        MetricSpec("step_time_s", "mean", fmt=".3f"),
        MetricSpec("bookkeeping_wait_s", "mean", fmt=".4f"),
        *(MetricSpec(name, "sum", fmt=fmt, sp_dedup=name == "samples") for name, fmt in sums),
        MetricSpec("peak_mem_mb", "max", fmt=".1f"),
    ]


def difference_metrics(reduced: Mapping[str, float], differences: Mapping[str, tuple[str, str]]) -> dict[str, float]:
    """{name: reduced[a] - reduced[b]} of `differences` ({name: (a, b)}) whose two metrics both have a value in the
    reduced window (each a mean over its own count, e.g. KTO's `rewards/margins`); a name missing either is omitted."""
    return {name: reduced[a] - reduced[b] for name, (a, b) in differences.items() if a in reduced and b in reduced}


def new_metrics_group() -> dist.ProcessGroup | None:
    """A gloo group over all ranks for metric reductions (None without a process group); collective, like every
    group creation, with the parallel state's timeout."""
    return get_parallel_state().new_group("gloo")


class StepEndError(RuntimeError):
    """A step-end bookkeeping task failed; `__cause__` is its own exception, with its traceback."""


def as_panels(name: str, spec: Sequence[str] | Sequence[sinks.Panel]) -> list[sinks.Panel]:
    """A `plots` entry as the figure's panels: a list of keys is one panel named by the file name's first word."""
    if all(isinstance(item, str) for item in spec):
        return [(name.split("_")[0], [str(key) for key in spec])]
    return [(label, list(keys)) for label, keys in spec]  # type: ignore[misc]


class MetricLogger:
    """The train and eval windows, the series, the sinks and the step-end worker of one run.

    `settings`: the `logging` config section. Only the main rank writes sinks (console, beside a progress bar through
    `tqdm.write`; metrics.jsonl; TensorBoard; loss_curve.png; W&B). `flops_per_token(full_seq_len)`: the model's FLOPs
    per token; `pad_id` marks padding in `input_ids` when a batch has no `sequence_ids`. `extra_specs`: a trainer's
    own train metrics (a name with a `/`, e.g. `rl/reward`, is logged as it is, others under `train/`); a model
    output's `"metrics"` entry, `{name: (total, count)}` of a `mean` metric or `{name: value}`, is recorded per
    micro-batch, and a `mean` metric `X/_sq` (the mean of the squares) turns into `X/std` at log time (population std,
    from exact sums). `differences`: `{name: (a, b)}`, metrics logged as a - b of two declared `mean` metrics, each
    exact over its own count in the window, when both have one (`difference_metrics`; KTO's `rewards/margins`).
    `plots`: more figures beside loss_curve.png (which draws `train/loss`, each loss key when there are several, and
    `eval/loss`), `{file name: series keys}` (one axes, named by the file name's first word: reward_curve.png,
    "reward") or `{file name: [(y label, series keys), ...]}` (stacked axes, `sinks.Panel`); an entry named
    loss_curve.png replaces the default one.
    """

    def __init__(
        self,
        settings: LoggingConfig,
        parallel: ParallelState,
        *,
        loss_names: list[str],
        output_dir: str | Path,
        max_steps: int,
        device: torch.device,
        flops_per_token: Callable[[int], float],
        loss_modes: LossModes | None = None,
        pad_id: int = 0,
        run_config: Mapping[str, Any] | None = None,
        extra_specs: Sequence[MetricSpec] = (),
        plots: Mapping[str, Sequence[str] | Sequence[sinks.Panel]] | None = None,
        differences: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        if settings.log_interval < 1:
            raise ValueError(f"MetricLogger: log_interval must be >= 1; got {settings.log_interval}")
        modes = LossModes.of(loss_modes)
        self.loss_names = list(loss_names)
        # (loss key, its tokens key, the count of its mode's denominator or None for token-sum, that count's factor)
        self._loss_keys = [
            (key, tokens_key(name), modes.count_key(name), modes.constant(name))
            for key, name in ((key, name_of_loss(key)) for key in self.loss_names)
        ]
        self.log_interval, self.max_steps, self.is_main = settings.log_interval, max_steps, parallel.rank == 0
        self.device, self.world_size, self.sp_size, self.pad_id = device, parallel.world_size, parallel.sp_size, pad_id
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops(device, settings.peak_tflops)
        specs = [*train_metric_specs(self.loss_names), *extra_specs]
        eval_specs = [MetricSpec(name, "sum") for name in ("loss", *self.loss_names)]
        group = new_metrics_group()
        self.train = MetricAccumulator(specs, group=group, sp_rank=parallel.sp_rank)
        self.eval = MetricAccumulator(eval_specs, group=group, sp_rank=parallel.sp_rank)
        self.series: Series = {}  # every rank appends the same values; the main rank's is read back on resume
        formats = {f"train/{s.name}": s.fmt for s in specs} | {f"eval/{s.name}": s.fmt for s in eval_specs}
        formats |= {f"train/{key}": fmt for key, fmt in _FORMATS.items()}
        self.plots = dict(plots or {})
        self.differences = dict(differences or {})
        declared = {s.name for s in specs}
        for name, pair in self.differences.items():
            if name in declared or not set(pair) <= declared:
                raise ValueError(f"MetricLogger: difference {name!r} = {pair} needs two declared metrics, a new name")
        self.sinks = self._sinks(settings, Path(output_dir), formats, run_config) if self.is_main else []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="step-end") if settings.async_step_end else None
        self._pending: list[Future[None]] = []
        self._failed = False  # a task failed: the tasks queued behind it are skipped
        self._micro: list[Any] = []  # this step's micro-batch records, until `record_step`
        self._warned: set[str] = set()
        self.last_logged: dict[str, Scalar] = {}
        self.tokens_seen = 0.0  # cumulative over the run (restored on resume)
        self.window_steps = 0  # steps recorded in the open window (host-side)
        self._window_start, self._closed = time.perf_counter(), False

    def _sinks(
        self, settings: LoggingConfig, output: Path, formats: dict[str, str], run_config: Mapping[str, Any] | None
    ) -> list[sinks.Sink]:
        write: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
        if progress_bar_shown(settings):
            from tqdm.auto import tqdm

            write = tqdm.write  # keeps the progress bar intact
        out = [
            sinks.ConsoleSink(formats, self.max_steps, write),
            sinks.JsonlSink(output / "metrics.jsonl", self.series),
        ]
        if settings.tensorboard:
            out.append(sinks.TensorBoardSink(output / "tensorboard"))
        if settings.plot:
            heads = [f"train/{name}" for name in self.loss_names] if len(self.loss_names) > 1 else []  # one: = loss
            figures = {"loss_curve.png": ["train/loss", *heads, "eval/loss"], **self.plots}
            out += [
                sinks.LossCurveSink(output / name, self.series, panels=as_panels(name, spec))
                for name, spec in figures.items()
            ]
        if settings.wandb:
            out.append(sinks.WandbSink(output / "wandb", settings.wandb_project, run_config))
        return out

    # ---------------------------------------------------------------- recording (local)

    def record_micro_batch(
        self,
        outputs: Mapping[str, torch.Tensor],
        micro_batch_token_len: Mapping[str, torch.Tensor],
        micro_batch: Mapping[str, torch.Tensor],
    ) -> None:
        """Keep this micro-batch's loss means, their token counts and its tokens seen (one device op, no host read)."""
        counts = micro_batch_token_len
        losses = [(outputs[k].detach(), counts[t], counts[w or t]) for k, t, w, _ in self._loss_keys]
        input_ids = micro_batch["input_ids"]
        flops = self.flops_per_token(input_ids.shape[1] * self.sp_size)
        if bool(micro_batch.get("padding_flag", False)):  # a token budget's no-target micro-batch (host tensor)
            self._micro.append((losses, torch.zeros((), dtype=torch.long), input_ids.numel(), flops, 0))
            return
        for name, value in outputs.get("metrics", {}).items():
            self.train.record_total(name, *value) if isinstance(value, tuple) else self.train.record(name, value)
        ids, whole = micro_batch.get(SEQUENCE_IDS), micro_batch.get(ATTENTION_SEQUENCE_IDS)
        seen = (ids != -1).sum() if ids is not None else (input_ids != self.pad_id).sum()  # -2: a shared prefix
        samples = whole.max() + 1 if whole is not None else input_ids.shape[0]  # packed: whole under SP; no read
        self._micro.append((losses, seen, input_ids.numel(), flops, samples))

    def _record_micro_batches(self) -> None:
        """The kept micro-batches into the window: per loss key sum(local mean x tokens) (a shard without tokens adds
        exactly 0, its NaN mean included) over its mode's denominator (the local count, so the ranks' counts add up
        to the step's; token-sum: 1 / W per rank, so a window averages its steps), tokens, samples, FLOPs."""
        micro, self._micro = self._micro, []
        if not micro:
            return
        if self.loss_names:
            n, losses = len(self.loss_names), [loss for record in micro for loss in record[0]]
            means = torch.stack([m for m, _, _ in losses]).view(-1, n).double()
            counts = torch.stack([c for _, c, _ in losses]).view(-1, n).to(means.device, non_blocking=True)
            weights = torch.stack([w for _, _, w in losses]).view(-1, n).sum(0).double()
            totals = (torch.where(counts > 0, means, 0.0) * counts).sum(0)
            for (key, _, weight_key, factor), total, weight in zip(self._loss_keys, totals.unbind(), weights.unbind()):
                self.train.record_total(key, total, weight * factor if weight_key else 1.0 / self.world_size)
        seen = torch.stack([m[1] for m in micro])
        self.train.record("tokens", seen.sum())
        self.train.record("positions", float(sum(m[2] for m in micro)))
        self.train.record("samples", sum(m[4] for m in micro))
        flops = torch.tensor([m[3] for m in micro], dtype=torch.float64, device=seen.device)
        self.train.record("flops", seen.double() @ flops)

    def record_step(
        self, grad_norm: torch.Tensor, *, lr: float, skipped: bool, step_time: float, bookkeeping_wait: float
    ) -> None:
        """One optimizer step's values with its micro-batches': `lr` is the rate the step trained with; `skipped` is
        agreed by every rank (counted once)."""
        self._record_micro_batches()
        values = {"grad_norm": grad_norm.float(), "lr": lr, "step_time_s": step_time}
        values |= {"bookkeeping_wait_s": bookkeeping_wait, "peak_mem_mb": peak_memory_mb(self.device)}
        if self.is_main:
            values["skipped_steps"] = float(skipped)
        for name, value in values.items():
            self.train.record(name, value)
        self.window_steps += 1

    # ---------------------------------------------------------------- log events

    def should_log(self, step: int) -> bool:
        return step % self.log_interval == 0 or step == self.max_steps

    def end_step(self, step: int, epoch: int, force: bool = False, release: Any = None) -> None:
        """At a log step (or when forced) hand the window to the worker; `release` (the step's batches) is dropped
        there, so freeing it is off the critical path too."""
        if release is not None:
            self._submit(lambda _batches: None, release)
        if force or self.should_log(step):
            now = time.perf_counter()
            seconds, self._window_start, self.window_steps = now - self._window_start, now, 0
            self._submit(self._log_train, step, epoch, self.train.take_window(), seconds)

    def _log_train(self, step: int, epoch: int, window: dict, seconds: float) -> None:
        reduced, derived = self.train.reduce(window), {}
        for name in [name for name in reduced if name.endswith("/_sq")]:
            base, square = name[: -len("/_sq")], reduced.pop(name)
            mean = reduced.get(base, reduced.get(f"{base}/mean"))
            if mean is not None:
                derived[f"{base}/std"] = max(square - mean * mean, 0.0) ** 0.5
        derived |= difference_metrics(reduced, self.differences)
        losses = [reduced[name] for name in self.loss_names if name in reduced]
        if losses:
            derived["loss"] = sum(losses)
        if "tokens" in reduced:
            if reduced.get("positions"):
                derived["padding_ratio"] = 1.0 - reduced["tokens"] / reduced["positions"]
            self.tokens_seen += reduced["tokens"]
            derived["tokens_seen"] = self.tokens_seen
            if seconds > 0:
                derived["tokens_per_s"] = reduced["tokens"] / seconds
        if "flops" in reduced and seconds > 0:
            derived["tflops"] = reduced["flops"] / seconds / 1e12
            if self.peak_flops:
                derived["mfu"] = reduced["flops"] / seconds / (self.peak_flops * self.world_size)
        self.last_logged = self._write(step, epoch, "train/", reduced, derived) or self.last_logged

    def _write(
        self, step: int, epoch: int, prefix: str, reduced: Mapping[str, float], extra: Mapping[str, object]
    ) -> dict[str, Scalar]:
        """Series and sinks get the scalars of `reduced` and `extra` (a bare key gets `prefix`) at `step`."""
        values: dict[str, object] = {(name if "/" in name else prefix + name): value for name, value in reduced.items()}
        for key, value in extra.items():
            key = key if "/" in key else prefix + key
            if key in values:
                raise ValueError(f"metrics: extra value {key!r} would overwrite the reduced metric at step {step}")
            values[key] = value
        logged = sinks.scalars(values, self._warned if self.is_main else None)
        if logged:
            sinks.append_series(self.series, step, epoch, logged)
            for sink in self.sinks:
                sink.write(step, epoch, logged)
        return logged

    def log_eval(
        self,
        step: int,
        epoch: int,
        scaled_totals: Mapping[str, torch.Tensor],
        extra: Mapping[str, object] | None = None,
    ) -> dict[str, Scalar]:
        """Collective. `scaled_totals`: per loss key, this rank's summed `mean_global_loss` outputs (their sum over
        ranks / W is the mean); `extra`: values already global (e.g. `caption_accuracy`), logged as they are."""
        self.wait_bookkeeping()  # eval reduces on the metrics group too: never beside a log task
        contributions = {key: value.detach().double().cpu() / self.world_size for key, value in scaled_totals.items()}
        for key, value in contributions.items():
            self.eval.record(key, value)
        if contributions:
            self.eval.record("loss", sum(contributions.values()))
        return self._write(max(step, 1), epoch, "eval/", self.eval.reduce(), extra or {})

    def write_text(self, step: int, tag: str, text: str) -> None:
        """Text for the sinks that show it (TensorBoard's text tab); main rank only, local."""
        for sink in self.sinks:
            if hasattr(sink, "write_text"):
                sink.write_text(step, tag, text)

    def postfix(self) -> str:
        """The progress bar's postfix: the last logged train loss."""
        return f"loss={self.last_logged['train/loss']:.4f}" if "train/loss" in self.last_logged else ""

    # ---------------------------------------------------------------- the worker thread

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._pool is None:
            return fn(*args)
        cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._pending.append(self._pool.submit(self._run, cuda, fn, *args))

    def _run(self, cuda: int | None, fn: Callable[..., None], *args: Any) -> None:
        if self._failed:
            return
        if cuda is not None:  # the current CUDA device is per thread
            torch.cuda.set_device(cuda)
        try:
            fn(*args)
        except BaseException:
            self._failed = True
            raise

    def wait_bookkeeping(self) -> None:
        """Wait for every submitted task; the first failure raises `StepEndError` (the tasks behind it were skipped)."""
        pending, self._pending = self._pending, []
        errors = [error for error in (future.exception() for future in pending) if error is not None]
        self._failed = False
        if errors:
            raise StepEndError(f"step-end bookkeeping failed: {errors[0]!r}") from errors[0]

    # ---------------------------------------------------------------- ends of a run

    def finish(self, step: int, epoch: int) -> dict[str, Scalar]:
        """Collective: log what the window still holds at `step` (the last trained step, of `epoch`; a step that
        raised on every rank after its micro-batches included), wait for the worker, flush the sinks; returns the
        last logged values."""
        self.wait_bookkeeping()
        self._record_micro_batches()
        if step > 0 and not self.train.is_empty:
            self.end_step(step, epoch, force=True)
        self.wait_bookkeeping()
        for sink in self.sinks:
            sink.flush()
        return self.last_logged

    def abort(self, step: int) -> None:
        """Exception path (no collective possible): wait for the worker without masking the original error, say
        which steps were not logged, close the sinks."""
        try:
            self.wait_bookkeeping()
        except StepEndError as exc:
            logger.error("step-end bookkeeping also failed: %r", exc.__cause__)
        if self.window_steps and self.is_main:
            first = step - self.window_steps + 1
            logger.warning(
                "steps %d-%d were trained but not logged (their reduction needs every rank); resuming retrains them "
                "from the newest checkpoint and logs them then",
                *(first, step),
            )
        self.train.take_window()
        self._micro, self.window_steps = [], 0
        for sink in self.sinks:
            sink.close()

    def close(self) -> None:
        """Local and idempotent: wait for the worker and close the sinks. An open window cannot be logged here (its
        reduction is a collective), so a non-empty one is named in a warning, never dropped silently."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_bookkeeping()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            for name, accumulator in (("train", self.train), ("eval", self.eval)):
                if not accumulator.is_empty:
                    unlogged = ", ".join(sorted(accumulator.take_window()))
                    logger.warning(
                        "metrics: the open %s window (%s) was never logged: its reduction is a collective and close() "
                        "is local; call finish() on every rank first",
                        *(name, unlogged),
                    )
            for sink in self.sinks:
                sink.close()

    # ---------------------------------------------------------------- checkpoints

    def checkpoint_state(self, step: int, epoch: int) -> dict[str, Any]:
        """Collective: log the open window at `step` first (a checkpoint holds none), then return what every rank
        shares: the cumulative token count. The history is metrics.jsonl, so this does not grow with the run."""
        self.finish(step, epoch)
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: Mapping[str, Any], step: int) -> None:
        """Continue after the checkpoint at `step`: the sinks drop later rows and the main rank's series is read
        back from metrics.jsonl."""
        self.tokens_seen = state.get("tokens_seen", 0.0)
        self.series.clear()
        for sink in self.sinks:
            sink.resume(step)
