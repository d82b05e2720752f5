"""An RL run's rollout metrics and rollouts sample (`RolloutRecords`, composed by `RLTrainer`).

Each rollout batch's metrics (`rl/reward/...`, `rl/rewards/<name>`, `rl/advantage/...`, response lengths, truncation,
staleness; off policy the engine's mismatch `rl/importance_ratio/...` and `rl/logprob_diff`) are this rank's share
(each sample recorded by one rank; `rl/dynamic_sampling/...`, the world's counts per batch, by rank 0), kept until
the step that trains the batch's first part records them; at log steps the main rank appends the batch's first
`rl.rollouts_sample` rollouts to rollouts.jsonl and TensorBoard's text tab.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from veomni_lite.metrics.accumulator import MetricSpec
from veomni_lite.rl.episodes import episode_metrics
from veomni_lite.rl.policy_loss import engine_mismatch
from veomni_lite.rl.rollouts import RolloutSample

ROLLOUTS_FILE = "rollouts.jsonl"

__all__ = ["ROLLOUTS_FILE", "RolloutRecords"]


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


class RolloutRecords:
    """The rollout metrics and rollouts sample of `trainer` (an `RLTrainer`). `pending`: this rank's metric values of
    the latest batch, not yet recorded."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.pending: dict[str, Any] = {}

    def specs(self) -> list[MetricSpec]:
        """The RL metrics (each reward's `rl/rewards/<name>` among them)."""
        specs = [
            *_spread_specs("rl/reward"),
            *(MetricSpec(f"rl/rewards/{r.name}", "mean") for r in getattr(self.trainer, "rewards", [])),
            *([MetricSpec("rl/rewards/overlong", "mean")] if self.trainer.rl.overlong_buffer else []),
            *(  # per rollout batch, the world's counts (rank 0 records them)
                MetricSpec(f"rl/dynamic_sampling/{name}", "mean", fmt=".1f")
                for name in ("generated_groups", "kept_groups", "dropped_groups", "rounds")
                if self.trainer.rl.dynamic_sampling
            ),
            MetricSpec("rl/frac_reward_zero_std", "mean"),
            *_spread_specs("rl/advantage"),
            MetricSpec("rl/response_length/mean", "mean", fmt=".1f"),
            MetricSpec("rl/response_length/min", "min", fmt=".0f"),
            MetricSpec("rl/response_length/max", "max", fmt=".0f"),
            MetricSpec("rl/truncated_ratio", "mean"),
            MetricSpec("rl/staleness", "mean", fmt=".1f"),  # optimizer steps between a sample's weights and now
            MetricSpec("rl/staleness/max", "max", fmt=".0f"),
            MetricSpec("rl/kl", "mean"),
            MetricSpec("rl/entropy", "mean"),
            *(MetricSpec(name, "mean") for name in self.trainer.policy.entry.metrics),  # the policy loss's
            MetricSpec("rl/importance_ratio/mean", "mean"),
            MetricSpec("rl/importance_ratio/min", "min"),
            MetricSpec("rl/importance_ratio/max", "max"),
            MetricSpec("rl/logprob_diff", "mean", fmt=".2e"),
            MetricSpec("time/generate_s", "mean", fmt=".2f"),
            MetricSpec("time/train_s", "mean", fmt=".2f"),
        ]
        rl = self.trainer.rl
        if rl.multi_turn:  # episodes (`veomni_lite.rl.episodes.episode_metrics`)
            from veomni_lite.rl.tools import load_tools

            specs += [MetricSpec("rl/turns/mean", "mean", fmt=".2f"), MetricSpec("rl/turns/max", "max", fmt=".0f")]
            means = ("tool_calls/mean", "tool_errors", "episode_truncated")
            specs += [MetricSpec(f"rl/{name}", "mean") for name in means]
            specs += [MetricSpec(f"rl/episode/{k}_tokens", "mean", fmt=".1f") for k in ("model", "env")]
            specs += [MetricSpec(f"rl/tool_calls/{tool.name}", "mean") for tool in load_tools(rl.tools)]
            if rl.environment:
                specs.append(MetricSpec("rl/rewards/environment", "mean"))
        return specs

    def rollouts(self, samples: list[RolloutSample]) -> None:
        """This rank's share of the batch's rollout metrics (each sample recorded by one rank)."""
        t = self.trainer
        record = self.pending = {}
        if not samples:
            return
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        record.update(_stats("rl/reward", rewards))
        for name in samples[0].rewards:
            values = torch.tensor([s.rewards[name] for s in samples], dtype=torch.float64)
            record[f"rl/rewards/{name}"] = (values.sum(), float(values.numel()))
        groups = rewards.view(-1, t.rl.num_generations)
        zero_std = (groups == groups[:, :1]).all(dim=1).double()
        record["rl/frac_reward_zero_std"] = (zero_std.sum(), float(zero_std.numel()))
        record.update(_stats("rl/advantage", torch.tensor([s.advantage for s in samples], dtype=torch.float64)))
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        record["rl/response_length/mean"] = (lengths.sum(), float(lengths.numel()))
        record["rl/response_length/min"], record["rl/response_length/max"] = lengths.min(), lengths.max()
        record.update(episode_metrics(samples))
        truncated = torch.tensor([float(s.truncated) for s in samples], dtype=torch.float64)
        record["rl/truncated_ratio"] = (truncated.sum(), float(truncated.numel()))
        if t.given is None:  # optimizer steps since the weights that sampled each (given rollouts: unknown)
            staleness = torch.tensor([float(t.step - s.version) for s in samples], dtype=torch.float64)
            record["rl/staleness"] = (staleness.sum(), float(staleness.numel()))
            record["rl/staleness/max"] = staleness.max()

    def engine_mismatch(self, samples: list[RolloutSample]) -> None:
        """`rl/importance_ratio` exp(old - engine) and `rl/logprob_diff` |old - engine| over the response tokens."""
        pairs = [
            _model_tokens(s, s.old_logprobs, s.engine_logprobs) for s in samples if s.engine_logprobs and s.old_logprobs
        ]
        if not pairs:
            return
        old = torch.tensor([x for o, _ in pairs for x in o], dtype=torch.float64)
        engine = torch.tensor([x for _, e in pairs for x in e], dtype=torch.float64)
        self.pending.update(engine_mismatch(old, engine, torch.ones_like(old, dtype=torch.bool)))

    def flush(self) -> None:
        """Record the pending rollout metrics (made with the batch, recorded with the step that trains its first
        part) and the step's times into the trainer's metrics; the rollouts sample at a log step (main rank)."""
        t = self.trainer
        records, self.pending = self.pending, {}
        for name, value in records.items():
            if isinstance(value, tuple):
                t.metrics.train.record_total(name, *value)
            else:
                t.metrics.train.record(name, value)
        t.metrics.train.record("time/generate_s", t.rollouts.generate_s)
        t.rollouts.generate_s = 0.0
        if t.is_main and t.metrics.should_log(t.step) and t.rl.rollouts_sample:
            self.write_sample()

    def write_sample(self) -> None:
        """The first `rl.rollouts_sample` rollouts of the current batch to rollouts.jsonl and TensorBoard's text tab."""
        t = self.trainer
        rows = [
            {"step": t.step, "prompt": s.prompt_text, "response": s.response_text, "reward": s.reward,
             "advantage": s.advantage, "truncated": s.truncated,
             **({"turns": s.episode["turns"]} if s.episode else {})}
            for s in t.rollouts.last[: t.rl.rollouts_sample]
        ]  # fmt: skip
        with (t.output_dir / ROLLOUTS_FILE).open("a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        table = "\n".join(
            f"| {row['reward']:.3g} | {row['advantage']:.3g} | {_cell(row['prompt'])} | {_cell(row['response'])} |"
            for row in rows
        )
        t.metrics.write_text(t.step, "rollouts", "| reward | advantage | prompt | response |\n|---|---|---|---|\n"
                                + table)  # fmt: skip

    def trim_file(self) -> None:
        """A fresh run starts rollouts.jsonl anew; a resumed one keeps the rows up to its step (main rank)."""
        t = self.trainer
        path = t.output_dir / ROLLOUTS_FILE
        if not t.is_main or not path.exists():
            return
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if t.step else []
        kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= t.step]
        path.write_text("".join(kept), encoding="utf-8")
