"""Training metrics: `accumulator` (declared reductions, local records, one packed SUM + one MAX per window, a
controller's merge), `sinks` (console, metrics.jsonl, TensorBoard, loss_curve.png, W&B) and `logger` (`MetricLogger`:
what the trainer records, the step-end worker, checkpoints and resume)."""

from veomni_lite.metrics.accumulator import REDUCTIONS, MetricAccumulator, MetricSpec
from veomni_lite.metrics.logger import MetricLogger, StepEndError, new_metrics_group

__all__ = ["REDUCTIONS", "MetricAccumulator", "MetricLogger", "MetricSpec", "StepEndError", "new_metrics_group"]
