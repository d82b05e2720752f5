"""Training metrics: declared specs, local recording, windowed cross-rank reduction, series, sinks.

Modules: `spec` (MetricSpec, formats), `accumulator` (record + packed reduce), `series` (durable history),
`scalars` (what a sink can log), `sinks` (console/JSONL/TensorBoard/PNG), `reporter` (ties them together),
`async_step` (StepEndWorker: step-end bookkeeping off the critical path).
"""

from veomni_lite.metrics.accumulator import MetricAccumulator, MetricWindow
from veomni_lite.metrics.async_step import StepEndError, StepEndWorker
from veomni_lite.metrics.reporter import EVAL_PREFIX, TRAIN_PREFIX, MetricReporter, new_metrics_group
from veomni_lite.metrics.scalars import as_scalar, split_scalars
from veomni_lite.metrics.series import MetricSeries
from veomni_lite.metrics.sinks import ConsoleSink, JsonlSink, LossCurveSink, Sink, TensorBoardSink, WandbSink
from veomni_lite.metrics.spec import REDUCTIONS, MetricSpec, format_value

__all__ = [
    "EVAL_PREFIX",
    "REDUCTIONS",
    "TRAIN_PREFIX",
    "ConsoleSink",
    "JsonlSink",
    "LossCurveSink",
    "MetricAccumulator",
    "MetricReporter",
    "MetricSeries",
    "MetricSpec",
    "MetricWindow",
    "Sink",
    "StepEndError",
    "StepEndWorker",
    "TensorBoardSink",
    "WandbSink",
    "as_scalar",
    "format_value",
    "new_metrics_group",
    "split_scalars",
]
