"""An RL run's rollout metrics and rollouts sample: the metrics of a rollout batch as plain dicts (`rollout_metrics`,
`engine_mismatch_metrics`, made by the pipeline, `veomni_lite.rl.pipeline`), their specs (`rollout_specs`), and
`RolloutRecords`, which records them and the rollouts sample.

Each rollout batch's metrics (`rl/reward/...`, `rl/rewards/<name>`, `rl/advantage/...`, response lengths, truncation,
staleness, under `rl.async_steps` its histogram `rl/staleness/hist/{d}`; off policy the engine's mismatch
`rl/importance_ratio/...`, `rl/logprob_diff`, `rl/mismatch/kl` and `rl/mismatch/ppl_ratio`) are this rank's share
(each sample recorded by one rank; `rl/dynamic_sampling/...`, the world's counts per batch, by rank 0), kept until
the step that trains the batch's first part records them; at log steps the main rank appends the batch's first
`rl.rollouts_sample` rollouts to rollouts.jsonl and TensorBoard's text tab.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from veomni_lite.metrics.accumulator import MetricSpec
from veomni_lite.rl.episodes import episode_metrics
from veomni_lite.rl.policy_loss import IS_CORRECTIONS, POLICY_LOSSES, engine_mismatch
from veomni_lite.rl.rollouts import RolloutSample

ROLLOUTS_FILE = "rollouts.jsonl"

__all__ = [
    "ROLLOUTS_FILE",
    "RolloutRecords",
    "engine_mismatch_metrics",
    "rollout_metrics",
    "rollout_specs",
    "staleness_histogram",
]


def _stats(prefix: str, values: torch.Tensor, weights: torch.Tensor | None = None) -> dict[str, Any]:
    """This rank's contribution to `prefix/mean`, `/_sq` (for std), `/min`, `/max` of `values` (float64)."""
    if values.numel() == 0:
        return {}
    weights = torch.ones_like(values) if weights is None else weights
    count = weights.sum()
    return {
        f"{prefix}/mean": ((values * weights).sum(), count),
        f"{prefix}/_sq": ((values * values * weights).sum(), count),
        f"{prefix}/min": values.min(),
        f"{prefix}/max": values.max(),
    }


def _spread_specs(prefix: str) -> list[MetricSpec]:
    return [
        MetricSpec(f"{prefix}/mean", "mean"),
        MetricSpec(f"{prefix}/_sq", "mean"),
        MetricSpec(f"{prefix}/min", "min"),
        MetricSpec(f"{prefix}/max", "max"),
    ]


def _model_tokens(sample: RolloutSample, *values: list[float]) -> tuple[list[float], ...]:
    """`values` (per response token) at the model's tokens alone (an episode's environment tokens dropped)."""
    mask = sample.response_mask
    return tuple(v if mask is None else [x for x, m in zip(v, mask) if m] for v in values)


def _cell(text: str) -> str:
    """`text` as one markdown table cell."""
    return text.replace("|", "\\|").replace("\n", "\\n")


def rollout_specs(rl: Any, reward_names: Sequence[str]) -> list[MetricSpec]:
    """The RL metrics of a run with `rl` (the `rl` section) and its rewards (`rl/rewards/<name>` each)."""
    specs = [
        *_spread_specs("rl/reward"),
        *(MetricSpec(f"rl/rewards/{name}", "mean") for name in reward_names),
        *([MetricSpec("rl/rewards/overlong", "mean")] if rl.overlong_buffer else []),
        *(  # per rollout batch, the world's counts (rank 0 records them)
            MetricSpec(f"rl/dynamic_sampling/{name}", "mean", fmt=".1f")
            for name in ("generated_groups", "kept_groups", "dropped_groups", "rounds")
            if rl.dynamic_sampling
        ),
        MetricSpec("rl/frac_reward_zero_std", "mean"),
        *_spread_specs("rl/advantage"),
        MetricSpec("rl/response_length/mean", "mean", fmt=".1f"),
        MetricSpec("rl/response_length/min", "min", fmt=".0f"),
        MetricSpec("rl/response_length/max", "max", fmt=".0f"),
        MetricSpec("rl/truncated_ratio", "mean"),
        MetricSpec("rl/staleness/mean", "mean", fmt=".1f"),  # optimizer steps between a sample's weights and now
        MetricSpec("rl/staleness/max", "max", fmt=".0f"),
        *([MetricSpec("rl/staleness/dropped", "mean", fmt=".0f")] if rl.async_steps else []),  # per batch, rank 0
        *(MetricSpec(f"rl/staleness/hist/{d}", "mean") for d in range(rl.async_steps + 1) if rl.async_steps),
        MetricSpec("rl/kl", "mean"),
        *([MetricSpec("rl/teacher/reverse_kl", "mean")] if rl.teacher else []),
        MetricSpec("rl/entropy", "mean"),
        *(MetricSpec(name, "mean") for name in POLICY_LOSSES.get(rl.policy_loss, "rl.policy_loss").metrics),
        *(
            MetricSpec(name, "mean")
            for name in IS_CORRECTIONS.get(rl.importance_sampling, "rl.importance_sampling").metrics
        ),
        MetricSpec("rl/mismatch/kl", "mean", fmt=".2e"),
        MetricSpec("rl/mismatch/ppl_ratio", "mean"),
        MetricSpec("rl/importance_ratio/mean", "mean"),
        MetricSpec("rl/importance_ratio/min", "min"),
        MetricSpec("rl/importance_ratio/max", "max"),
        MetricSpec("rl/logprob_diff", "mean", fmt=".2e"),
        MetricSpec("time/generate_s", "mean", fmt=".2f"),
        MetricSpec("time/train_s", "mean", fmt=".2f"),
    ]
    if rl.multi_turn:  # episodes (`veomni_lite.rl.episodes.episode_metrics`)
        from veomni_lite.rl.tools import load_tools

        specs += [MetricSpec("rl/turns/mean", "mean", fmt=".2f"), MetricSpec("rl/turns/max", "max", fmt=".0f")]
        means = ("tool_calls/mean", "tool_errors", "episode_truncated")
        specs += [MetricSpec(f"rl/{name}", "mean") for name in means]
        specs += [MetricSpec(f"rl/episode/{k}_tokens", "mean", fmt=".1f") for k in ("model", "env")]
        for tool in load_tools(rl.tools):
            specs += [
                MetricSpec(f"rl/tool_calls/{tool.name}", "mean"),
                MetricSpec(f"rl/tool_error_rate/{tool.name}", "mean"),
            ]
        if rl.environment:
            specs.append(MetricSpec("rl/rewards/environment", "mean"))
    return specs


def staleness_histogram(
    samples: Sequence[RolloutSample], step: int, steps_per_rollout: int, bound: int
) -> dict[str, tuple[float, float]]:
    """This rank's share of `rl/staleness/hist/{d}`, d = 0..`bound`: (response tokens d rollout batches stale, all its
    response tokens), d = ceil((step - the token's version) / steps_per_rollout) (versions: `RolloutSample.versions`,
    else the sample's `version` for each token; the model's tokens of an episode), capped at `bound` (the staleness
    bound k keeps every token within it)."""
    counts = [0] * (bound + 1)
    for sample in samples:
        versions = sample.versions if sample.versions is not None else [sample.version] * len(sample.response_ids)
        for version in _model_tokens(sample, versions)[0]:
            counts[min(max(-(-(step - version) // steps_per_rollout), 0), bound)] += 1
    total = float(sum(counts))
    return {f"rl/staleness/hist/{d}": (float(n), total) for d, n in enumerate(counts)}


def rollout_metrics(
    samples: Sequence[RolloutSample],
    group_size: int,
    step: int | None,
    steps_per_rollout: int = 1,
    async_steps: int = 0,
) -> dict[str, Any]:
    """This rank's share of a batch's rollout metrics (each sample recorded by one rank); `step`: the optimizer steps
    trained when it was made, for the staleness (None: given rollouts, whose weights are unknown); under
    `async_steps` k >= 1 also the staleness histogram in rollout batches of `steps_per_rollout` steps
    (`staleness_histogram`)."""
    record: dict[str, Any] = {}
    if not samples:
        return record
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    record.update(_stats("rl/reward", rewards))
    for name in samples[0].rewards:
        values = torch.tensor([s.rewards[name] for s in samples], dtype=torch.float64)
        record[f"rl/rewards/{name}"] = (values.sum(), float(values.numel()))
    groups = rewards.view(-1, group_size)
    zero_std = (groups == groups[:, :1]).all(dim=1).double()
    record["rl/frac_reward_zero_std"] = (zero_std.sum(), float(zero_std.numel()))
    record.update(_stats("rl/advantage", torch.tensor([s.advantage for s in samples], dtype=torch.float64)))
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    record["rl/response_length/mean"] = (lengths.sum(), float(lengths.numel()))
    record["rl/response_length/min"], record["rl/response_length/max"] = lengths.min(), lengths.max()
    record.update(episode_metrics(samples))
    truncated = torch.tensor([float(s.truncated) for s in samples], dtype=torch.float64)
    record["rl/truncated_ratio"] = (truncated.sum(), float(truncated.numel()))
    if step is not None:  # optimizer steps since the weights that sampled each
        staleness = torch.tensor([float(step - s.version) for s in samples], dtype=torch.float64)
        record["rl/staleness/mean"] = (staleness.sum(), float(staleness.numel()))
        record["rl/staleness/max"] = staleness.max()
        if async_steps:
            record.update(staleness_histogram(samples, step, steps_per_rollout, async_steps))
    return record


def engine_mismatch_metrics(samples: Sequence[RolloutSample]) -> dict[str, Any]:
    """The engine's mismatch with the old log-probabilities over the model's response tokens (`engine_mismatch`)."""
    pairs = [
        _model_tokens(s, s.old_logprobs, s.engine_logprobs) for s in samples if s.engine_logprobs and s.old_logprobs
    ]
    if not pairs:
        return {}
    old = torch.tensor([[x for o, _ in pairs for x in o]], dtype=torch.float64)
    engine = torch.tensor([[x for _, e in pairs for x in e]], dtype=torch.float64)
    sequences = torch.tensor([[i for i, (o, _) in enumerate(pairs) for _ in o]])
    return engine_mismatch(old, engine, torch.ones_like(old, dtype=torch.bool), sequences)


class RolloutRecords:
    """Where a run's rollout metrics and rollouts sample go: `flush` at each step, rollouts.jsonl under `output_dir`
    (written by the main rank, `rollouts_sample` rows at log steps)."""

    def __init__(self, output_dir: Path, is_main: bool, rollouts_sample: int) -> None:
        self.output_dir, self.is_main, self.rollouts_sample = output_dir, is_main, rollouts_sample

    def flush(self, metrics: Any, step: int, made: Any, last: Sequence[RolloutSample]) -> None:
        """Record into `metrics` (the trainer's `MetricLogger`, at step `step`) the metrics of the rollout batch `made`
        for the step that trains its first part (None: no batch made for this step) and its generation seconds; at a
        log step the first `rollouts_sample` rollouts of `last` (the latest generated batch), main rank."""
        for name, value in (made.metrics if made is not None else {}).items():
            if isinstance(value, tuple):
                metrics.train.record_total(name, *value)
            else:
                metrics.train.record(name, value)
        metrics.train.record("time/generate_s", made.generate_s if made is not None else 0.0)
        if self.is_main and metrics.should_log(step) and self.rollouts_sample:
            self.write_sample(metrics, step, last)

    def write_sample(self, metrics: Any, step: int, last: Sequence[RolloutSample]) -> None:
        """The first `rollouts_sample` rollouts of `last` to rollouts.jsonl and TensorBoard's text tab."""
        rows = [
            {"step": step, "prompt": s.prompt_text, "response": s.response_text, "reward": s.reward,
             "advantage": s.advantage, "truncated": s.truncated,
             **({"turns": s.episode["turns"]} if s.episode else {})}
            for s in last[: self.rollouts_sample]
        ]  # fmt: skip
        with (self.output_dir / ROLLOUTS_FILE).open("a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        table = "\n".join(
            f"| {row['reward']:.3g} | {row['advantage']:.3g} | {_cell(row['prompt'])} | {_cell(row['response'])} |"
            for row in rows
        )
        metrics.write_text(step, "rollouts", "| reward | advantage | prompt | response |\n|---|---|---|---|\n"
                           + table)  # fmt: skip

    def trim_file(self, step: int) -> None:
        """A fresh run starts rollouts.jsonl anew; a resumed one keeps the rows up to its step (main rank)."""
        path = self.output_dir / ROLLOUTS_FILE
        if not self.is_main or not path.exists():
            return
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if step else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(kept), encoding="utf-8")
