"""Online RL on the one train loop: `RLTrainer`, an `SFTTrainer` whose loader (`RolloutLoader`) makes each optimizer
step from a rollout batch.

The trainer reads the prompts (or given rollouts), builds the model, its frozen reference (`rl.kl_coef` > 0) and the
rollout engine (`veomni_lite.engines`), and composes three parts, one module each:
  `RolloutBatches` (`rollout_batch.py`)  rollout batch k: generated on the engine (synced), scored, gathered in batch
                                         order, group advantages;
  `LogprobPasses` (`logprob_pass.py`)    the batch planned into this rank's micro-batches (marked, SP-sliced) and the
                                         old / reference log-probabilities computed on them before its first update;
  `RolloutRecords` (`records.py`)        the batch's metrics and the rollouts sample.
Each optimizer step then runs the loop's step: `LossStep` + `mean_global_loss` make it exactly the mode's value over
the step's responses on every rank, one loss all-reduce per step; `RLTrainer.forward` asks the model for the response
tokens' log-probabilities and entropies (`LogprobRequest`: the LM head fused with them, the [tokens, vocab] logits
never whole) and turns them into the policy loss (`PolicyLoss`). `evaluate`: greedy responses to the eval prompts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import read_sources
from veomni_lite.distributed.collectives import agree, all_reduce
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.engines.base import RolloutEngine
from veomni_lite.engines.embedded import TransformersEngine
from veomni_lite.engines.weights import engine_model
from veomni_lite.loss_keys import is_labels_key
from veomni_lite.metrics.accumulator import MetricSpec
from veomni_lite.metrics.sinks import Panel
from veomni_lite.models.heads import LogprobRequest
from veomni_lite.models.pretrained import read_model_directory
from veomni_lite.post_training import ReferenceWeights
from veomni_lite.rl.config import POLICY, RLConfig
from veomni_lite.rl.critic import VALUE, VALUE_LABELS, Critic
from veomni_lite.rl.episodes import make_agent
from veomni_lite.rl.loader import RolloutLoader
from veomni_lite.rl.logprob_pass import LogprobPasses
from veomni_lite.rl.policy_loss import POLICY_LABELS, PolicyLoss
from veomni_lite.rl.prompts import PromptSet, encode_row, read_prompts
from veomni_lite.rl.records import RolloutRecords
from veomni_lite.rl.rewards import check_answers, load_rewards
from veomni_lite.rl.rollout_batch import EVALUATION, RolloutBatches
from veomni_lite.rl.rollouts import RolloutSample, collate_rollouts, read_rollouts
from veomni_lite.trainer.sft import SFTTrainer
from veomni_lite.utils.loss_utils import mark_sequences

logger = logging.getLogger(__name__)
ROLLOUTS_FILE = "rollouts.jsonl"

__all__ = ["RLTrainer"]


class RLTrainer(SFTTrainer):
    """See the module docstring. `config.rl` is the `rl` section (`veomni_lite.rl.config.RLConfig`)."""

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
        self.rollouts = RolloutBatches(self)
        self.passes = LogprobPasses(self)
        self.records = RolloutRecords(self)
        self.critic = Critic.of(self)  # rl.advantage: gae: the value head and its loss (`veomni_lite.rl.critic`)
        super().__init__(config)
        self.records.trim_file()

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
            train = read_prompts(read_sources(data.train_path, "data.train_path"), *options)
            if len(train) < rl.prompts_per_step:
                raise DataError(f"data.train_path: {len(train)} prompts, fewer than rl.prompts_per_step")
        evaluation = None
        if data.eval_path and self.config.train.eval_interval:
            evaluation = read_prompts(read_sources(data.eval_path, "data.eval_path"), *options)
        for prompts in (train, evaluation):  # every row's answer, where a reward needs one, before any rollout
            if prompts is not None:
                check_answers(self.rewards, [p.answer for p in prompts.prompts], [p.where for p in prompts.prompts])
        return train, evaluation

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

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """`RolloutSample.tensors` -> one micro-batch (`collate_rollouts` over the SFT collate of the model)."""
        return collate_rollouts(samples, super().collate, self.config.data.packing)

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
        """The reference (the initial weights, where `rl.kl_coef` > 0) and the rollout engine's model."""
        if self.rl.kl_coef:
            skip = self.critic.parameters(self.model) if self.critic is not None else ()
            self.reference = ReferenceWeights(self.model, skip)
        if self.given is None:
            self.engine = self._build_engine()
            self.agent = make_agent(self) if self.rl.multi_turn else None

    def _build_engine(self) -> RolloutEngine:
        """`rl.engine`: the embedded engine on each rank, or a vLLM server reached by rank 0 (collective)."""
        if self.rl.engine == "vllm":
            from veomni_lite.engines.vllm import VLLMEngine, VLLMSettings

            vision = self.images is not None  # the server renders VL prompts itself (images: its chat route)
            image = self.model_config.image_token_id if vision else None
            probe = [t for t in self.train_dataset.prompts[0].ids if t != image]
            return VLLMEngine(
                VLLMSettings.parse(self.rl.vllm), self.config.model.pretrained_dir, self.control_group,
                self.passes.probe, probe, self.output_dir / "vllm_server.log", renders_prompts=vision,
            )  # fmt: skip
        return TransformersEngine(engine_model(self.model_config, self.config.parallel.master_dtype), self.device)

    def close(self) -> None:
        """The engine released too (a launched vLLM server stopped), then the trainer's own."""
        if self.engine is not None:
            self.engine.close()
        super().close()

    def _make_loader(self, dataset: Any, seed: int, prefetch_steps: int = 0, token_budget: bool = False) -> Any:
        return RolloutLoader(self)

    def _run_length(self) -> int:
        train = self.config.train
        if train.epochs:
            return train.epochs * self.loader.steps_per_epoch
        return train.max_steps

    def _log_run_length(self) -> None:
        if self.is_main:
            rl = self.rl
            logger.info(
                "run: %d optimizer steps; each rollout batch of %d prompts x %d samples trains %d epoch(s) of %d "
                "step(s) of %d responses; lr %g",
                self.max_steps, rl.prompts_per_step, rl.num_generations, rl.epochs, self.loader.minibatches,
                self.config.train.global_batch_size, self.config.optim.lr,
            )  # fmt: skip

    def shard(self, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rollout loader's micro-batches are marked and sliced already (`prepare`)."""
        return micro_batch

    def mark_and_slice(self, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.loss_modes.needs_sequences():
            micro_batch = mark_sequences(micro_batch, self.loss_modes)
        return slice_micro_batch(micro_batch, self.parallel.sp_rank, self.parallel.sp_size, pad_id=self.pad_id)

    def model_logprobs(self, batch: Mapping[str, Any], request: LogprobRequest) -> dict[str, torch.Tensor]:
        """The model's {"logprobs", "entropy"} of `request` on a prepared micro-batch (the LM head fused with them
        unless `model.fused_lm_head` is false: `LogprobRequest`)."""
        return self.model(**{k: v for k, v in batch.items() if not is_labels_key(k)}, logprobs=request)

    def forward(self, micro_batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """The policy loss of one micro-batch from the model's log-probabilities and entropies (see `PolicyLoss`)."""
        batch = self.preforward(micro_batch)
        outputs = self.model_logprobs(batch, LogprobRequest(batch[POLICY_LABELS], self.rl.temperature, entropy=True))
        loss = self.policy(outputs, batch, self.parallel.sp_group if self.parallel.sp_size > 1 else None)
        return loss if self.critic is None else self.critic.add_value_loss(loss, batch, f"{POLICY}_loss")

    @torch.no_grad()
    def logprobs(self, micro_batch: Mapping[str, Any]) -> torch.Tensor:
        """[B, S] log-probabilities of the micro-batch's `policy_labels` under the current weights (eval mode)."""
        batch = self.preforward(micro_batch)
        request = LogprobRequest(batch[POLICY_LABELS], self.rl.temperature)
        return self.model_logprobs(batch, request)["logprobs"].double().cpu()

    @property
    def on_policy(self) -> bool:
        """One optimizer step per rollout batch (one mini-batch, one epoch): the old log-probabilities are the
        training forward's own, detached (TRL and verl), so no forward computes them first."""
        return self.loader.steps_per_rollout == 1

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """The loop's step, with this step's rollout metrics and times recorded (`RolloutRecords.flush`)."""
        start = time.perf_counter()
        super().train_step(micro_batches)
        self.metrics.train.record("time/train_s", time.perf_counter() - start)
        self.records.flush()

    def metric_specs(self) -> list[MetricSpec]:
        return self.records.specs() + (self.critic.specs() if self.critic is not None else [])

    def train(self) -> dict[str, float]:
        """The loop; a fresh run with evaluation on first evaluates the starting weights (logged at step 1, the step
        that trains them; steps count from 1)."""
        if self.step == 0 and self.config.train.eval_interval:
            self.evaluate()
        return super().train()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy responses to the `data.eval_path` prompts: `eval/reward`, `eval/rewards/<name>` and `eval/accuracy`
        (the share of responses whose every reward is at its maximum, 1), the same on every rank."""
        if self.eval_dataset is None or self.engine is None:
            return {}
        prompts = self.eval_dataset.prompts
        samples = self.rollouts.generate(EVALUATION, prompts, self.rollouts.sampling(greedy=True))
        names = [r.name for r in self.rewards]
        best = sum(max(r.weight, 0.0) for r in self.rewards)
        totals = [
            sum(s.reward for s in samples),
            sum(float(math.isclose(s.reward, best)) for s in samples),
            float(len(samples)),
            *(sum(s.rewards[name] for s in samples) for name in names),
        ]
        reduced = all_reduce(totals, op="sum", group=self.control_group)
        count = max(reduced[2], 1.0)
        extra = {"reward": reduced[0] / count, "accuracy": reduced[1] / count}
        extra |= {f"eval/rewards/{name}": value / count for name, value in zip(names, reduced[3:])}
        return self.metrics.log_eval(self.step, self.epoch, {}, extra)
