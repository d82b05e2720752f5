"""Online RL on the one train loop: `RLTrainer`, an `SFTTrainer` whose loader (`RolloutLoader`) slices each optimizer
step from a rollout batch.

The trainer reads the prompts (or given rollouts), builds the model, its frozen reference (`rl.kl_coef` > 0) and the
rollout engine (`veomni_lite.engines`), and orchestrates:
  `RolloutPipeline` (`pipeline.py`)  rollout batch k stage by stage (generate -> score -> advantages -> old /
                                     reference log-probabilities -> values -> micro-batches) from a `RolloutContext`
                                     the trainer builds once the model and engine exist (no stage sees the trainer);
  `RolloutLoader` (`loader.py`)      the batch's micro-batches sliced into optimizer steps (resume state);
  `RolloutRecords` (`records.py`)    each batch's metrics, recorded with the step that trains its first part, and the
                                     rollouts sample.
Each optimizer step then runs the loop's step (the loop marks and SP-slices the micro-batches, `shard`): `LossStep` +
`mean_global_loss` make it exactly the mode's value over the step's responses on every rank, one loss all-reduce per
step; `RLTrainer.forward` asks the model for the response tokens' log-probabilities and entropies (`LogprobRequest`:
the LM head fused with them, the [tokens, vocab] logits never whole) and turns them into the policy loss
(`PolicyLoss`). `evaluate`: greedy responses to the eval prompts.

Mixture-of-experts policies: RL's router load-balancing coefficient defaults to 0 (`moe.aux_loss_coef` unset; set it
to train the head): the balance term is not the reward's, and its gradient moves the router away from the routing
the rollouts were sampled with (TRL and Unsloth set it to 0 for GRPO). `rl.routing_replay` (`old` or `rollout`): a
micro-batch carries the experts to route to (`routed_experts`); `forward` replays them, its record of the model's
own choices giving `rl/routing/mismatch`, and keeps the replay on until the micro-batch's backward has run (an
activation-checkpointing recompute replays the same experts). With `moe.balance: global-batch`, a step whose
micro-batches carry experts (the old pass's, recorded without replay too, or the rollout's) trains with the f of
those experts (`RouterLosses.step_slots`): this step's own, exact where they are the experts its forward uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from veomni_lite.config import ConfigError
from veomni_lite.data.checks import DataError
from veomni_lite.data.loader import StepLoader
from veomni_lite.data.sft import read_sources
from veomni_lite.distributed.collectives import agree, all_reduce
from veomni_lite.engines.background import BackgroundEngine
from veomni_lite.engines.base import RolloutEngine
from veomni_lite.engines.embedded import TransformersEngine
from veomni_lite.engines.weights import engine_model
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.metrics.accumulator import MetricSpec
from veomni_lite.metrics.sinks import Panel
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.models.pretrained import read_model_directory
from veomni_lite.models.routing import record_routing, routers, routing_mismatch
from veomni_lite.post_training import ReferenceWeights
from veomni_lite.rl.config import POLICY, RLConfig
from veomni_lite.rl.critic import VALUE, VALUE_LABELS, Critic
from veomni_lite.rl.episodes import make_agent
from veomni_lite.rl.hubs import hub_sources
from veomni_lite.rl.loader import RolloutLoader
from veomni_lite.rl.logprob_pass import model_logprobs, policy_logprobs, probe, replay_experts, replayed
from veomni_lite.rl.pipeline import RolloutContext, RolloutPipeline
from veomni_lite.rl.policy_loss import POLICY_LABELS, PolicyLoss
from veomni_lite.rl.prompts import PromptSet, encode_row, read_prompts
from veomni_lite.rl.records import RolloutRecords, rollout_specs
from veomni_lite.rl.rewards import check_answers, load_rewards
from veomni_lite.rl.rollout_batch import generate, sampling
from veomni_lite.rl.rollouts import EVALUATION, RolloutSample, collate_rollouts, read_rollouts
from veomni_lite.rl.teacher import make_teacher
from veomni_lite.trainer.base import shard_micro_batch
from veomni_lite.trainer.sft import SFTTrainer

logger = logging.getLogger(__name__)

__all__ = ["RLTrainer"]


class RLTrainer(SFTTrainer):
    """See the module docstring. `config.rl` is the `rl` section (`veomni_lite.rl.config.RLConfig`)."""

    evaluates_starting_weights = True

    plots: dict[str, list[Panel]] = {  # the policy loss alone (it sits near 0), each quantity on its own axes
        "loss_curve.png": [("policy loss", ["train/policy_loss"]), ("KL", ["rl/kl"]), ("entropy", ["rl/entropy"])],
        "reward_curve.png": [
            ("reward", ["rl/reward/mean", "eval/reward"]),
            ("response tokens", ["rl/response_length/mean", "rl/response_length/max"]),
        ],
    }

    def __init__(self, config: Any) -> None:
        self.rl: RLConfig = config.rl
        self.policy = PolicyLoss.of(self.rl)
        self.reference: ReferenceWeights | None = None
        self.engine: RolloutEngine | None = None
        self.agent: Any = None  # multi-turn: the episodes' `Agent`
        self.rollouts: RolloutPipeline | None = None  # built once the model and the engine exist (`on_model_built`)
        self.critic = Critic.of(self.rl)  # rl.advantage: gae: the value head and its loss (`veomni_lite.rl.critic`)
        self.replay = contextlib.ExitStack()  # a micro-batch's routing replay, from its forward through its backward
        if config.moe.aux_loss_coef is None:  # RL trains no load balancing unless asked (the module docstring)
            config.moe.aux_loss_coef = 0.0
        super().__init__(config)
        self.records = RolloutRecords(self.output_dir, self.is_main, self.rl.rollouts_sample)
        self.records.trim_file(self.step)

    @property
    def rollouts_per_epoch(self) -> int:
        """Rollout batches per pass over the prompts (0: given rollouts, one pass)."""
        if self.given is not None:
            return len(self.given) // self.rl.rollout_size
        return self.train_dataset.batches_per_epoch(self.rl.prompts_per_step)

    def build_datasets(self) -> tuple[Any, Any | None]:
        """The prompts of `data.train_path` and `data.eval_path` (or the rollouts of `rl.rollouts_path`), read alike on
        every rank, every row checked before the first rollout (rendering, images, length, and its answer where a
        configured reward needs one: the error its rollout batch would raise); an input error on one rank is a
        DataError on every rank."""
        problem: Exception | None = None
        train = evaluation = None
        self.given: list[RolloutSample] | None = None
        try:
            train, evaluation = self._read_inputs()
        except (DataError, ValueError) as exc:
            problem = exc
        agree(problem, DataError, self.control_group, where="RL data: ")
        return train, evaluation

    def _read_inputs(self) -> tuple[Any, Any | None]:
        model, data, rl = self.config.model, self.config.data, self.rl
        if not model.pretrained_dir:
            raise DataError("model.pretrained_dir: RL needs a local transformers model directory")
        directory = read_model_directory(model.pretrained_dir, data.chat_template, data.train_on_prompt)
        self.model_config, self.tokenizer, self.encoder = directory.config, directory.tokenizer, directory.encoder
        self.images = directory.images
        vision = self.images is not None
        self.rewards = load_rewards(rl.rewards, ".") if rl.rewards else []
        prompt_len = max(data.max_seq_len - rl.max_new_tokens, 0)
        renders = vision and rl.engine == "vllm"  # the server renders VL prompts from their messages and images
        if renders and data.format == "text":
            raise DataError(
                "data.format: text has no chat messages, which rl.engine: vllm sends with a VL prompt's images; use a "
                "chat format (messages, sharegpt, ...) or rl.engine: transformers"
            )
        renders = renders or rl.multi_turn  # episodes render their turns after the prompt's messages
        if rl.multi_turn and data.format == "text":
            raise DataError("data.format: text has no chat messages to render episode turns after; use a chat format")
        options = (self.encoder, self.images, data.format, data.columns, data.media_dir, prompt_len, renders)
        if rl.rollouts_path:
            self.given = read_rollouts(
                rl.rollouts_path, rl.num_generations, self._encode_given_prompt,
                lambda text: self.tokenizer(text, add_special_tokens=False)["input_ids"],
                self.end_of_turn[0], self.vocab_size,
            )  # fmt: skip
            if len(self.given) < rl.rollout_size:
                raise DataError(
                    f"rl.rollouts_path: {len(self.given)} rollouts, fewer than one rollout batch ({rl.rollout_size})"
                )
            train: Any = PromptSet([])
        else:
            if not data.train_path:
                raise DataError("data.train_path: RL needs the prompts (a file, a list, a directory or a glob)")
            train = read_prompts(self._prompt_sources(data.train_path, "data.train_path"), *options)
            if len(train) < rl.prompts_per_step:
                raise DataError(f"data.train_path: {len(train)} prompts, fewer than rl.prompts_per_step")
        evaluation = None
        if data.eval_path and self.config.train.eval_interval:
            evaluation = read_prompts(self._prompt_sources(data.eval_path, "data.eval_path"), *options)
        for prompts in (train, evaluation):  # every row's answer, where a reward needs one, before any rollout
            if prompts is not None:
                check_answers(self.rewards, [p.answer for p in prompts.prompts], [p.where for p in prompts.prompts])
        first = self.given[0].prompt_ids if self.given is not None else train.prompts[0].ids  # rl.teacher's probe
        self.teacher = rl.teacher and make_teacher(rl.teacher, model.pretrained_dir, self.tokenizer, first, vision)
        return train, evaluation

    def _prompt_sources(self, spec: Any, key: str) -> list[Any]:
        """The files of `spec`, or a hub's prompt source (`reasoning_gym:`, `verifiers:`; `veomni_lite.rl.hubs`)."""
        hub = hub_sources(spec, key, self.rl.environment, self.rl.environment_kwargs)
        return hub if hub is not None else read_sources(spec, key)

    @property
    def end_of_turn(self) -> list[int]:
        """The ids that end a response: the template's end-of-turn run, the tokenizer's eos."""
        return sorted(self.encoder.end_of_turn)

    def _encode_given_prompt(self, row: Mapping[str, Any], where: str) -> tuple[list[int], str, dict]:
        prompt = row["prompt"]
        if isinstance(prompt, str):
            row = {"messages": [{"role": "user", "content": prompt}], "images": row.get("images") or []}
        else:
            row = {"messages": prompt, "images": row.get("images") or []}
        data = self.config.data
        base = Path(data.media_dir) if data.media_dir else Path(self.rl.rollouts_path).parent
        encoded = encode_row(row, where, self.encoder, self.images, "messages", {}, base)
        return encoded.ids, encoded.text, encoded.model_inputs

    def collator(self) -> Callable[[Sequence[Mapping[str, torch.Tensor]]], dict[str, torch.Tensor]]:
        """`RolloutSample.tensors` -> one micro-batch (`collate_rollouts` over the SFT collate of the model)."""
        return functools.partial(collate_rollouts, collate=super().collator(), packing=self.config.data.packing)

    @property
    def label_limits(self) -> dict[str, int]:
        return {POLICY_LABELS: self.vocab_size, VALUE_LABELS: self.vocab_size}

    def trained_loss_keys(self, model: Any) -> tuple[str, ...]:
        return (f"{POLICY}_loss",) + ((f"{VALUE}_loss",) if self.critic is not None else ())

    def build_model(self) -> Any:
        model = super().build_model()
        return self.critic.attach(model) if self.critic is not None else model

    def materialize(self, model: torch.nn.Module) -> None:
        if self.critic is None:
            return super().materialize(model)
        self.critic.materialize(model, super().materialize)

    def make_optimizer(self) -> torch.optim.Optimizer:
        if self.critic is None:
            return super().make_optimizer()
        return self.critic.optimizer(self.model, self.config.optim)  # the critic's groups at rl.critic.lr

    def make_scheduler(self) -> Any:
        if self.critic is None:
            return super().make_scheduler()
        return self.critic.scheduler(self.optimizer, self.config.optim, self.max_steps)  # the policy after warm-up

    def _build_with_adapters(self) -> Any:
        model = super()._build_with_adapters()
        if self.critic is not None and self.lora is not None:
            self.critic.train_whole(model)
        return model

    def _check_loss_weights(self, model: Any) -> None:
        """The policy loss applies `policy_loss_weights` itself (`PolicyLoss`)."""

    def on_model_built(self) -> None:
        """The reference (the initial weights, where `rl.kl_coef` > 0), the rollout engine, and the rollout pipeline
        with its context."""
        if self.rl.routing_replay != "none" and not routers(self.model):
            raise ConfigError(
                f"rl.routing_replay: {self.rl.routing_replay}, but the policy "
                f"({type(self.model).__name__}) has no mixture-of-experts router; set rl.routing_replay none"
            )
        if self.rl.kl_coef:
            skip = self.critic.parameters(self.model) if self.critic is not None else ()
            self.reference = ReferenceWeights(self.model, skip)
        context = self._rollout_context()
        if self.given is None:
            self.engine = self._build_engine(context)
            data = self.config.data
            template = self.encoder.template if data.chat_template else None
            self.agent = make_agent(self.rl, data, self.tokenizer, template) if self.rl.multi_turn else None
            context = dataclasses.replace(context, engine=self.engine, agent=self.agent)
        self.rollouts = RolloutPipeline(context)

    def _rollout_context(self) -> RolloutContext:
        """What the pipeline's stages need (`RolloutContext`), without the engine (built on it: the vLLM probe)."""
        train, data = self.config.train, self.config.data
        collate = self.collator()
        planner = StepLoader(
            collate, train.global_batch_size, train.micro_batch_size, self.parallel.dp_size,
            self.parallel.dp_rank, 0, data.max_tokens_per_micro_batch, data.packing,
        )  # fmt: skip
        return RolloutContext(
            rl=self.rl, seed=train.seed, parallel=self.parallel, control_group=self.control_group,
            tokenizer=self.tokenizer, encoder=self.encoder, chat_template=bool(data.chat_template),
            image_token_id=self.model_config.image_token_id if self.images is not None else None,
            rewards=self.rewards, prompts=self.train_dataset, given=self.given, engine=None, agent=None,
            planner=planner, model=self.model, lora=self.lora, reference=self.reference, critic=self.critic,
            collate=collate, global_f=self.router is not None and self.router.balance == "global-batch",
            shard=functools.partial(
                shard_micro_batch, loss_modes=self.loss_modes, parallel=self.parallel, pad_id=self.pad_id
            ),
            logprobs=functools.partial(policy_logprobs, self.model, self.device), teacher=self.teacher,
        )  # fmt: skip

    def _build_engine(self, context: RolloutContext) -> RolloutEngine:
        """`rl.engine`: the embedded engine on each rank, or a vLLM server reached by rank 0 (collective)."""
        if self.rl.engine == "vllm":
            from veomni_lite.engines.vllm import VLLMEngine, VLLMSettings

            vision = self.images is not None  # the server renders VL prompts itself (images: its chat route)
            image = self.model_config.image_token_id if vision else None
            probe_ids = [t for t in self.train_dataset.prompts[0].ids if t != image]
            return VLLMEngine(
                VLLMSettings.parse(self.rl.vllm), self.config.model.pretrained_dir, self.control_group,
                functools.partial(probe, context), probe_ids, self.output_dir / "vllm_server.log",
                renders_prompts=vision,
            )  # fmt: skip
        model = engine_model(self.model_config, self.config.parallel.master_dtype)
        counts, record = getattr(self.images, "token_counts", None), self.rl.routing_replay == "rollout"
        engine = TransformersEngine(model, self.device, image_tokens=counts, record_experts=record)
        return BackgroundEngine(engine, self.parallel.rank) if self.rl.async_steps else engine

    def close(self) -> None:
        """The engine released too (a launched vLLM server stopped), then the trainer's own."""
        if self.engine is not None:
            self.engine.close()
        super().close()

    def _make_loader(self, dataset: Any, seed: int, prefetch_steps: int = 0, token_budget: bool = False) -> Any:
        assert self.rollouts is not None
        return RolloutLoader(self.rollouts, self.rollouts_per_epoch)

    def _run_length(self) -> int:
        self.loader.max_steps = super()._run_length()  # no background generation for a batch past the run
        return self.loader.max_steps

    def _log_run_length(self) -> None:
        if self.is_main:
            rl = self.rl
            logger.info(
                "run: %d optimizer steps; each rollout batch of %d prompts x %d samples trains %d epoch(s) of %d "
                "step(s) of %d responses; lr %g",
                self.max_steps, rl.prompts_per_step, rl.num_generations, rl.epochs, self.loader.minibatches,
                self.config.train.global_batch_size, self.config.optim.lr,
            )  # fmt: skip

    def forward(self, micro_batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """The policy loss of one micro-batch from the model's log-probabilities and entropies (see `PolicyLoss`)."""
        self.replay.close()  # the previous micro-batch's backward has run
        batch = self.preforward(micro_batch)
        given = replay_experts(batch, self.rl.routing_replay)
        own = self.replay.enter_context(record_routing(self.model)) if given is not None else None
        self.replay.enter_context(replayed(self.model, batch))  # after the record: it sees the model's own top-k
        request = LogprobRequest(batch[POLICY_LABELS], self.rl.temperature, entropy=True)
        outputs = model_logprobs(self.model, batch, request)
        loss = self.policy(outputs, batch, self.parallel.sp_group if self.parallel.sp_size > 1 else None)
        if own is not None:
            valid = batch[POLICY_LABELS] != IGNORE_INDEX  # the positions whose predictions train
            experts = list(given.flatten(0, 1).unbind(1))
            loss["metrics"]["rl/routing/mismatch"] = routing_mismatch(own, experts, valid)
        if self.critic is None:
            return loss
        return self.critic.add_value_loss(loss, batch, f"{POLICY}_loss", self.step)

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """The loop's step, with the metrics of the rollout batch it starts (if it starts one), its times and the
        rollouts sample recorded (`RolloutRecords.flush`)."""
        start = time.perf_counter()
        self.rollouts.start_ahead(self.step)  # async: the batches ahead generate while this step trains
        try:
            super().train_step(micro_batches)
        finally:
            self.replay.close()
        self.metrics.train.record("time/train_s", time.perf_counter() - start)
        self.loader.trained = self.step
        self.records.flush(self.metrics, self.step, self.loader.take_made(), self.rollouts.last)

    def metric_specs(self) -> list[MetricSpec]:
        specs = rollout_specs(self.rl, [r.name for r in getattr(self, "rewards", [])])
        if self.rl.routing_replay != "none":
            specs.append(MetricSpec("rl/routing/mismatch", "mean"))
        return specs + (self.critic.specs() if self.critic is not None else [])

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy responses to the `data.eval_path` prompts: `eval/reward`, `eval/rewards/<name>` and `eval/accuracy`
        (the share of responses whose every reward is at its maximum, 1; not with an environment, whose rewards have
        no known maximum), the same on every rank."""
        if self.eval_dataset is None or self.engine is None:
            return {}
        context = self.rollouts.context
        samples = generate(context, EVALUATION, self.eval_dataset.prompts, sampling(context, greedy=True), self.step)
        names = [r.name for r in self.rewards]
        totals = [
            sum(s.reward for s in samples),
            accurate(samples, self.rewards),
            float(len(samples)),
            *(sum(s.rewards[name] for s in samples) for name in names),
        ]
        reduced = all_reduce(totals, op="sum", group=self.control_group)
        count = max(reduced[2], 1.0)
        extra = {"reward": reduced[0] / count}
        if not self.rl.environment:
            extra["accuracy"] = reduced[1] / count
        extra |= {f"eval/rewards/{name}": value / count for name, value in zip(names, reduced[3:])}
        return self.metrics.log_eval(self.step, self.epoch, {}, extra)


def accurate(samples: Sequence[RolloutSample], rewards: Sequence[Any]) -> float:
    """How many `samples` have every reward at its maximum, 1: the total at the sum of the positive weights, and each
    reward of weight 0 (in no total, logged: `rl.teacher`'s runs) at 1."""
    best = sum(max(r.weight, 0.0) for r in rewards)
    logged = [r.name for r in rewards if r.weight == 0]
    return float(sum(math.isclose(s.reward, best) and all(math.isclose(s.rewards[n], 1.0) for n in logged)
                     for s in samples))  # fmt: skip
