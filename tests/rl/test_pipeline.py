"""The RL pipeline (`veomni_lite.rl.pipeline`): one rollout batch walks its stages once each, in order, each called
by the pipeline itself (no stage calls back into another); the loader only slices the batch into steps; and no part
the trainer orchestrates (pipeline, its context and generation state, loader, records, critic) holds the trainer,
nor does any function the context carries."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from veomni_lite.config import load_config
from veomni_lite.rl import pipeline, rollout_batch
from veomni_lite.rl.config import RLConfig
from veomni_lite.rl.trainer import RLTrainer


@pytest.fixture(scope="module")
def math_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from examples.rl_math import write_demo

    return write_demo(tmp_path_factory.mktemp("rl_math"), sft_rows=16, rl_rows=64, eval_rows=8)


def build(demo: Path, out: Path, *extra: str) -> RLTrainer:
    """Rollout batches of 4 prompts x 4 samples in 2 mini-batches (off policy: the old log-probabilities' pass
    runs), a reference (`rl.kl_coef`)."""
    args = [
        "--model.arch", "auto", "--model.pretrained_dir", str(demo / "models/qwen2_math"),
        "--data.train_path", str(demo / "rl_train.jsonl"), "--data.format", "messages", "--data.max_seq_len", "64",
        "--rl.prompts_per_step", "4", "--rl.num_generations", "4", "--rl.max_new_tokens", "8",
        "--rl.rewards", "[{name: correct, function: math}]", "--rl.kl_coef", "0.05",
        "--train.micro_batch_size", "2", "--train.global_batch_size", "8", "--train.max_steps", "4",
        "--train.output_dir", str(out), "--optim.lr", "1e-3", "--optim.warmup_steps", "0",
        "--logging.progress_bar", "false", "--logging.tensorboard", "false", "--logging.plot", "false", *extra,
    ]  # fmt: skip
    return RLTrainer(load_config(None, args, world_size=1, sections={"rl": RLConfig}))


# (module, function name) of each stage; the inner ones (generate, score, gather) run inside `collect`.
STAGES = [
    (rollout_batch.RolloutSource, "collect"),
    (rollout_batch, "generate"),
    (rollout_batch, "score"),
    (rollout_batch, "gather"),
    (pipeline, "advantages"),
    (pipeline, "rollout_metrics"),
    (pipeline, "plan"),
    (pipeline, "needs_fill"),
    (pipeline, "fill"),
    (pipeline, "gae_advantages"),
    (pipeline, "engine_mismatch_metrics"),
    (pipeline, "collate_plans"),
]


def record_stages(monkeypatch: pytest.MonkeyPatch, more: Sequence[tuple[Any, str]] = ()) -> list[tuple[str, int]]:
    """Each stage (and `more`) wrapped to append (name, depth) when called: depth 0 is a call made by the pipeline
    itself, 1 one made inside another stage."""
    trace: list[tuple[str, int]] = []
    depth = [0]

    def wrap(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            trace.append((name, depth[0]))
            depth[0] += 1
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1

        return recorded

    for owner, name in [*STAGES, *more]:
        monkeypatch.setattr(owner, name, wrap(name, getattr(owner, name)))
    return trace


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_one_rollout_batch_walks_its_stages_once_in_order(math_demo, tmp_path, monkeypatch, advantage):
    extra = ["--rl.advantage", "gae", "--rl.critic", "{value_head: true}"] if advantage == "gae" else []
    trainer = build(math_demo, tmp_path, *extra)
    try:
        trace = record_stages(monkeypatch)
        first = trainer.loader.next_step()
        expected = [("collect", 0), ("generate", 1), ("score", 2), ("gather", 1)]
        expected += [("advantages", 0)] if advantage == "grpo" else []  # gae: from the critic's values, below
        expected += [("rollout_metrics", 0), ("plan", 0), ("needs_fill", 0), ("fill", 0)]
        expected += [("gae_advantages", 0)] if advantage == "gae" else []
        expected += [("engine_mismatch_metrics", 0), ("collate_plans", 0)]
        assert trace == expected
        made = trainer.loader.take_made()
        assert made is not None and made.index == 0 and len(made.samples) == 16 and made.generate_s > 0
        assert all(s.old_logprobs is not None and s.ref_logprobs is not None for s in made.samples)
        assert len(first) == len(made.micro_batches[0]) == 4  # 8 responses a mini-batch, 2 a micro-batch
        trace.clear()
        second = trainer.loader.next_step()  # the batch's second mini-batch: sliced, nothing made
        assert trace == [] and trainer.loader.take_made() is None
        assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(second, made.micro_batches[1]))
    finally:
        trainer.close()


def _cells(function: Any) -> list[Any]:
    """The values of a function's closure cells (an empty cell skipped)."""
    values = []
    for cell in function.__closure__ or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:
            continue
    return values


@pytest.mark.slow
def test_episodes_walk_the_same_stages_and_score_through_the_scoring_stage(tmp_path, monkeypatch):
    """Multi-turn: the episodes replace the engine's generation inside `generate` and are scored by the pipeline's
    scoring stage (`rollout_batch.score`, handed to them). On policy without a reference: no forward pass."""
    from examples.agent_calc import write_demo
    from tests.rl.test_agent_train import agent_args
    from veomni_lite.rl import episodes

    demo = write_demo(tmp_path / "demo", sft_rows=16, rl_rows=16, eval_rows=4)
    trainer = RLTrainer(load_config(None, agent_args(demo, tmp_path / "run"), world_size=1, sections={"rl": RLConfig}))
    try:
        trace = record_stages(monkeypatch, [(episodes, "generate_episodes")])
        trainer.loader.next_step()
        assert trace == [
            ("collect", 0), ("generate", 1), ("generate_episodes", 2), ("score", 3), ("gather", 1),
            ("advantages", 0), ("rollout_metrics", 0), ("plan", 0), ("needs_fill", 0), ("collate_plans", 0),
        ]  # fmt: skip
        assert all(s.episode is not None for s in trainer.rollouts.last)
    finally:
        trainer.close()


def holders(root: Any, target: Any) -> Iterator[str]:
    """The paths under `root` (attributes, dataclass fields, container items, a function's closure and partial
    arguments, a bound method's object) at which `target` is found; torch modules and tensors are not entered."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:
        path, value = stack.pop()
        if value is target:
            yield path
            continue
        if id(value) in seen or isinstance(value, (torch.nn.Module, torch.Tensor, str, bytes, int, float, type)):
            continue
        seen.add(id(value))
        children: list[tuple[str, Any]] = []
        if isinstance(value, dict):
            children = [(f"[{k!r}]", v) for k, v in value.items()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            children = [(f"[{i}]", v) for i, v in enumerate(value)]
        elif isinstance(value, functools.partial):
            children = [(".func", value.func), *((f".args[{i}]", a) for i, a in enumerate(value.args))]
        elif hasattr(value, "__self__") and hasattr(value, "__func__"):  # a bound method
            children = [(".__self__", value.__self__)]
        elif callable(value) and hasattr(value, "__closure__"):
            children = [(f".<closure {i}>", cell) for i, cell in enumerate(_cells(value))]
        else:
            if dataclasses.is_dataclass(value):
                children = [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
            children += [(f".{k}", v) for k, v in getattr(value, "__dict__", {}).items()]
        stack.extend((path + name, child) for name, child in children)


@pytest.mark.slow
def test_no_part_holds_the_trainer(math_demo, tmp_path):
    trainer = build(math_demo, tmp_path, "--rl.advantage", "gae", "--rl.critic", "{value_head: true}")
    try:
        trainer.loader.next_step()  # a batch made: the loader and the pipeline hold their state
        parts = {"pipeline": trainer.rollouts, "loader": trainer.loader, "records": trainer.records}
        parts["critic"] = trainer.critic
        assert {name: list(holders(part, trainer)) for name, part in parts.items()} == {name: [] for name in parts}
        # The walk reaches through the context's functions (the policy's collate, SP slice and forward) to what they
        # hold: the model, which the trainer holds too.
        assert ".context.logprobs.args[0]" in list(holders(parts["pipeline"], trainer.model))
        # Controls: the walk finds the trainer where a part holds it (the old parts' `self.trainer`), or a function
        # bound to it (the context's functions were the trainer's methods before).
        trainer.rollouts.source.trainer = trainer
        context = trainer.rollouts.context
        trainer.rollouts.context = dataclasses.replace(context, shard=trainer.shard)
        assert sorted(holders(parts["pipeline"], trainer)) == [".context.shard.__self__", ".source.trainer"]
    finally:
        trainer.close()
