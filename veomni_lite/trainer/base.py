"""The one train loop. Each job's trainer only supplies the model, the datasets and the collate function.

Per optimizer step:
  1. the loader yields this rank's GA micro-batches; `mark_sequences` marks them for a per-sequence loss mode; under
     SP each is then sliced to this rank's sequence shard;
  2. every micro-batch is validated on the host (it is still on the CPU) and one small control all-reduce on a CPU
     group agrees, across ranks, on stop requests (SIGTERM), bad data and the micro-batch count, before any
     collective that could hang;
  3. the step's `LossStep` (veomni_lite.plain_loop) counts it once; per micro-batch: `preforward` (to device) ->
     model -> `postforward` (`mean_global_loss`, keys summed) -> backward. Loss normalization costs one small
     all-reduce per step (13 int64), inside `mean_global_loss`; metrics are recorded locally (no
     collective, no host read);
  4. gradient clipping with the true global norm over FSDP shards: its one all-reduce also counts the ranks whose
     loss is non-finite, so after the step's one host read every rank takes the same decision (step, skip or raise);
     AdamW + the LR schedule (`veomni_lite.trainer.lr_schedule`);
  5. end-of-step bookkeeping (log-time metric reduction, sink writes) runs on a worker thread and overlaps the next
     step; the next optimizer update waits for it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import inspect
import logging
import math
import os
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from veomni_lite.config import Config, ConfigError, OptimConfig
from veomni_lite.data.checks import DataError, data_problem, validate_micro_batch
from veomni_lite.data.loader import MicroBatchLoader
from veomni_lite.data.packing import padding_micro_batch
from veomni_lite.distributed.collectives import agree, all_gather_objects, all_reduce, destroy_process_groups
from veomni_lite.distributed.expert_parallel import check_expert_parallel
from veomni_lite.distributed.fsdp import (
    apply_fsdp,
    check_sharded,
    checkpoint_activations,
    reshard,
    resolve_mixed_precision,
    set_gradient_sync,
)
from veomni_lite.distributed.grad_norm import clip_global_grad_norm
from veomni_lite.distributed.parallel_state import ParallelState, init_parallel_state
from veomni_lite.distributed.sequence_parallel import slice_micro_batch
from veomni_lite.loss_keys import ATTENTION_SEQUENCE_IDS, loss_weights_key, name_of_loss
from veomni_lite.metrics import MetricLogger
from veomni_lite.metrics.accumulator import MetricSpec
from veomni_lite.metrics.logger import progress_bar_shown
from veomni_lite.metrics.sinks import Panel
from veomni_lite.models.contract import HostInput, TrainableModel, check_model_contract, with_companions
from veomni_lite.models.lora import (
    LoraError,
    LoraSettings,
    apply_lora,
    init_adapters,
    whole_modules,
    write_adapter_config,
)
from veomni_lite.models.moe import LOAD_IMBALANCE, router_losses, write_loads
from veomni_lite.models.pretrained import load_model
from veomni_lite.models.registry import DTYPES, family_of
from veomni_lite.models.sharded_load import (
    build_on_meta,
    load_into_shards,
    loadable,
    rank0_weights,
    scatter_from_rank0,
)
from veomni_lite.plain_loop import LossStep
from veomni_lite.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    model_settings_of,
    rng_state,
    set_rng_state,
)
from veomni_lite.trainer.lr_schedule import lr_lambda, ratio_steps
from veomni_lite.utils.loss_utils import (
    LossKeyMismatchError,
    mark_sequences,
    mean_global_loss,
)

logger = logging.getLogger(__name__)

MODEL_CONFIG_DIR = "model_config"


class NonFiniteError(FloatingPointError):
    """A step produced a non-finite loss or gradient norm (train.nonfinite = "error")."""


class TrainingInterrupted(SystemExit):
    """SIGTERM/SIGINT ended the run after saving what was safe to save; exit code 128 + signal."""


def init_distributed(timeout_s: float) -> torch.device:
    """Join the torchrun process group (NCCL on CUDA, else gloo) with a collective timeout; return the device."""
    if "RANK" in os.environ and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def parameter_groups(model: torch.nn.Module, weight_decay: float, decay_on: str = "matrices") -> list[dict[str, Any]]:
    """AdamW groups of the parameters that train (frozen ones, e.g. a LoRA base, get no optimizer state): with
    `decay_on="matrices"` only weight matrices decay (parameters of 2+ dimensions outside embeddings); biases, norms
    and embeddings do not. `"all"`: every parameter decays."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    decay, keep = [], []
    for param in (p for p in model.parameters() if p.requires_grad):
        matrix = param.dim() >= 2 and id(param) not in embeddings
        (decay if decay_on == "all" or matrix else keep).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": keep, "weight_decay": 0.0}]


def experts_apart(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group split in two (same settings) where it holds fused routed experts (`expert_modules`) and other
    parameters: under expert parallelism the experts are DTensors of another mesh than FSDP2's other parameters, which
    AdamW's foreach and fused kernels cannot mix; split at every ep_size alike, so a checkpoint's groups are the same
    at every ep size. A model without routed experts: the groups unchanged."""
    from veomni_lite.distributed.expert_parallel import expert_modules

    experts = {id(p) for module in expert_modules(model) for p in module.parameters()}
    out = []
    for group in groups:
        parts = [[p for p in group["params"] if id(p) not in experts], [p for p in group["params"] if id(p) in experts]]
        out += [{**group, "params": part} for part in parts if part] if all(parts) else [group]
    return out


# optim.implementation -> AdamW's (foreach, fused); auto is torch's own choice.
ADAMW_KERNELS: dict[str, tuple[bool | None, bool | None]] = {
    "auto": (None, None),
    "fused": (None, True),
    "foreach": (True, None),
    "for_loop": (False, False),
}


def build_optimizer(
    model: torch.nn.Module, optim: OptimConfig, groups: list[dict[str, Any]] | None = None
) -> torch.optim.AdamW:
    """AdamW over `groups` (default `parameter_groups`), with the config's lr, betas, eps and kernels; each group
    with the routed experts apart (`experts_apart`)."""
    foreach, fused = ADAMW_KERNELS[optim.implementation]
    return torch.optim.AdamW(
        experts_apart(
            model, parameter_groups(model, optim.weight_decay, optim.weight_decay_on) if groups is None else groups
        ),
        lr=optim.lr,
        betas=(optim.betas[0], optim.betas[1]),
        eps=optim.eps,
        foreach=foreach,
        fused=fused,
    )


def warmup_steps(optim: OptimConfig, max_steps: int) -> int:
    """`optim.warmup_steps`, or `optim.warmup_ratio` of a run of `max_steps` steps."""
    return optim.warmup_steps or ratio_steps(optim.warmup_ratio, max_steps)


def build_scheduler(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, max_steps: int, delays: Sequence[int] | None = None
) -> LambdaLR:
    """`optim.schedule` over a run of `max_steps` steps (see `veomni_lite.trainer.lr_schedule`). `delays`: per
    optimizer group, a number of first steps at lr 0 (PPO's critic warm-up for the policy's groups), after which the
    group runs the schedule of a run that many steps shorter."""

    def schedule(steps: int) -> Any:
        decay = ratio_steps(optim.decay_ratio, steps)
        return lr_lambda(optim.schedule, warmup_steps(optim, steps), steps, optim.min_lr_ratio, decay)

    if not delays or not any(delays):
        return LambdaLR(optimizer, schedule(max_steps))

    def delayed(delay: int) -> Any:
        shorter = schedule(max(1, max_steps - delay))
        return lambda step: 0.0 if step < delay else shorter(step - delay)

    return LambdaLR(optimizer, [delayed(delay) for delay in delays])


def shard_micro_batch(
    micro_batch: dict[str, torch.Tensor], loss_modes: Any, parallel: ParallelState, pad_id: int
) -> dict[str, torch.Tensor]:
    """The per-sequence loss keys of `loss_modes` marked on the whole micro-batch, then this rank's sequence shard (a
    no-op without SP)."""
    if loss_modes.needs_sequences():
        micro_batch = mark_sequences(micro_batch, loss_modes)
    return slice_micro_batch(micro_batch, parallel.sp_rank, parallel.sp_size, pad_id=pad_id)


def to_device(micro_batch: Mapping[str, Any], device: torch.device, host_inputs: Sequence[str]) -> dict[str, Any]:
    """Move tensors to `device`, except a model's `host_inputs` (what it reads on the host, so that reading them
    costs no device sync; the model moves them itself), which go wrapped in `HostInput`: FSDP2's root pre-forward
    would move them to a CUDA device otherwise."""
    return {
        key: (HostInput(value) if key in host_inputs else value.to(device, non_blocking=True))
        if isinstance(value, torch.Tensor)
        else value
        for key, value in micro_batch.items()
    }


class BaseTrainer(ABC):
    """Build everything from a Config, then `train()`. Subclasses implement the three `build_*` hooks."""

    plots: dict[str, list[str] | list[Panel]] = {}  # figures: {file name: series keys or panels} (see MetricLogger)
    evaluates_starting_weights = False  # a fresh run evaluates before its first step too (post-training's curves)

    def __init__(self, config: Config) -> None:
        self.config = config
        train = config.train
        self.output_dir = Path(train.output_dir)
        self.device = init_distributed(config.parallel.collective_timeout_s)
        self.parallel: ParallelState = init_parallel_state(
            config.dp_size,
            config.parallel.sp_size,
            timeout_s=config.parallel.collective_timeout_s,
            dp_replicate=config.parallel.dp_replicate,
            ep_size=config.parallel.ep_size,
        )
        self.rank = self.parallel.rank
        self.is_main = self.rank == 0
        self.control_group = self.parallel.new_group("gloo")
        self.loss_modes = config.loss.resolved()
        try:
            self.lora = LoraSettings.parse(config.model.lora)
        except LoraError as exc:
            raise ConfigError(str(exc)) from None
        self._sync_every_micro_batch = config.parallel.gradient_sync == "every_micro_batch"
        torch.manual_seed(train.seed)

        self.train_dataset, self.eval_dataset = self.build_datasets()
        model, scatter, weights = self._build_model()
        on_meta = any(param.is_meta for param in model.parameters())  # filled shard by shard after fully_shard
        model = check_model_contract(model if on_meta else model.to(self.device))
        try:  # before any collective of the layout: every rank has the same model and config
            check_expert_parallel(model, config.parallel.ep_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.loss_keys: tuple[str, ...] = self.trained_loss_keys(model)
        self.labeled_loss_keys = self.loss_keys  # the heads whose `<name>_labels` every micro-batch carries
        self.router = router_losses(model, config.moe)  # None: a dense decoder
        if self.router is not None:
            self.loss_keys += self.router.loss_keys
            self.loss_modes = self.router.modes(self.loss_modes)
        self._check_loss_weights(model)
        models = with_companions(model)
        for each in models:
            self._set_attention(each)
        self._set_experts(models)
        model.fused_lm_head = config.model.fused_lm_head  # read by the transformers models' loss heads
        self._check_packing(model)
        # Called per micro-batch for the FLOPs metric: the parameter count is walked once per sequence length.
        self.flops_per_token = functools.lru_cache(maxsize=None)(model.flops_per_token)
        if self.parallel.sp_enabled:
            for each in models:
                each.enable_sequence_parallel(self.parallel.sp_group)
            if self.router is not None:  # whole samples counted over the SP group
                self.router.enable_sequence_parallel(self.parallel.sp_group)
        layers = [layer for each in models for layer in each.layers]
        if config.parallel.activation_checkpointing:
            checkpoint_activations(layers)
        bf16 = resolve_mixed_precision(config.parallel.mixed_precision, self.device)
        self.model = apply_fsdp(model, self.parallel, layers, bf16=bf16)
        if on_meta:
            self.model.to_empty(device=self.device)
            if scatter:
                scatter_from_rank0(self.model, weights)
            else:
                self.materialize(self.model)
            del weights
            if self.lora is not None:
                init_adapters(self.model, train.seed)  # each rank its shards of the values a whole build has
        self.on_model_built()
        prefetch = config.data.prefetch_steps if config.data.prefetch_steps >= 0 else int(self.device.type != "cpu")
        self.loader = self._make_loader(self.train_dataset, train.seed, prefetch, token_budget=True)
        self.max_steps = self._run_length()
        # A forward before training (a reference pass, a warm-up) leaves FSDP2's root gathered: the optimizer and the
        # grad norm must hold the shards, which FSDP2 updates (see veomni_lite.distributed.fsdp).
        reshard(self.model)
        self.trainable = [param for param in self.model.parameters() if param.requires_grad]
        self.optimizer = self.make_optimizer()
        check_sharded(self.model, (param for group in self.optimizer.param_groups for param in group["params"]))
        self.scheduler = self.make_scheduler()
        self._log_run_length()
        self.checkpoints = CheckpointManager(
            self.output_dir / "checkpoints",
            keep=config.checkpoint.keep_checkpoints,
            trainable_only=self.lora is not None,
        )
        self.checkpoints.check_shared()
        self.metrics = self.build_metrics()
        self.step = 0
        self.epoch = 0  # the epoch of the last trained step (the loader may have fetched the next one)
        self._saved_step = -1
        self._stop_signal: int | None = None
        if config.checkpoint.resume:
            self._resume()
        if self.is_main:
            config.save(self.output_dir / "config.yaml")
            model.save_config(self.output_dir / MODEL_CONFIG_DIR)  # what `python -m veomni_lite.export` rebuilds
            # the adapters' PEFT config, naming the base directory (none: an earlier LoRA run's is removed)
            write_adapter_config(model, self.lora, config.model.pretrained_dir, self.output_dir / MODEL_CONFIG_DIR)

    def _run_length(self) -> int:
        """The run's optimizer steps: `train.max_steps`, or `train.epochs` x the loader's steps per epoch."""
        train = self.config.train
        return train.epochs * self.loader.steps_per_epoch if train.epochs else train.max_steps

    def _log_run_length(self) -> None:
        """Rank 0 logs the run's length in steps and epochs, and its schedule."""
        if not self.is_main:
            return
        train, optim = self.config.train, self.config.optim
        if self.loader.steps_per_epoch is None:  # a stream (data.streaming): epochs of unknown length
            logger.info(
                "run: %d optimizer steps of train.global_batch_size %d streamed samples; lr %g, %s schedule, %d warmup "
                "steps", self.max_steps, train.global_batch_size, optim.lr, optim.schedule,
                warmup_steps(optim, self.max_steps),
            )  # fmt: skip
            return
        samples, per_epoch = len(self.train_dataset), self.loader.steps_per_epoch
        length = f"train.epochs {train.epochs}" if train.epochs else f"{self.max_steps / per_epoch:.3g} epochs"
        logger.info(
            "run: %d optimizer steps = %s of %d steps (%d training samples // train.global_batch_size %d; %d left "
            "out of each epoch); lr %g, %s schedule, %d warmup steps",
            self.max_steps,
            length,
            per_epoch,
            samples,
            train.global_batch_size,
            samples - per_epoch * train.global_batch_size,
            optim.lr,
            optim.schedule,
            warmup_steps(optim, self.max_steps),
        )

    @property
    def _sharded_build(self) -> bool:
        """Several ranks and `model.load_sharded`: the model is built on meta and only its shards are filled."""
        return self.parallel.is_distributed and self.config.model.load_sharded

    def _build_model(self) -> tuple[TrainableModel, bool, dict[str, torch.Tensor] | None]:
        """(model, scatter, rank 0's weights or None). One process, or `model.load_sharded false`: `build_model` on
        every rank. Else rank 0 runs it as is (the seeded values a whole build has) and the other ranks run it on
        the meta device; rank 0 keeps its weights and moves its model to meta as well, and after `fully_shard` they
        are scattered into the shards (scatter). A model that rank 0 too returns on meta (a pretrained directory,
        see `pretrained_model`) is left to `materialize`. One broadcast shares rank 0's choice and CPU RNG state, so
        every rank decides alike and continues from the RNG state a whole build leaves."""
        if not self._sharded_build:
            return self._build_with_adapters(), False, None
        with contextlib.nullcontext() if self.is_main else torch.device("meta"):
            model = self._build_with_adapters()
        on_meta = any(param.is_meta for param in model.parameters())
        shared = torch.cat([torch.tensor([on_meta], dtype=torch.uint8), torch.get_rng_state()])
        dist.broadcast(shared, src=0, group=self.control_group)
        torch.set_rng_state(shared[1:].clone())
        if shared[0]:
            return model, False, None
        weights = rank0_weights(model) if self.is_main else None
        return model.to("meta"), True, weights

    def _build_with_adapters(self) -> TrainableModel:
        """`build_model`, then `model.lora`'s adapters on it (the base frozen; see `veomni_lite.models.lora`)."""
        model = self.build_model()
        if self.lora is None:
            return model
        try:
            targets = apply_lora(model, self.lora, self.config.train.seed)
        except LoraError as exc:
            raise ConfigError(str(exc)) from None
        if self.is_main:
            trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            whole = whole_modules(model)
            logger.info(
                "model.lora: rank %d adapters on %d layers (%s)%s; %d of %d parameters train (%.3g%%)",
                self.lora.rank,
                len(targets),
                ", ".join(sorted({path.rsplit(".", 1)[-1] for path in targets})),
                f", {', '.join(whole)} trained whole" if whole else "",
                trained,
                total,
                100 * trained / total,
            )
        return model

    def pretrained_model(self, directory: str | Path) -> Any:
        """The model of a local `from_pretrained` directory, its parameters in `parallel.master_dtype` (float32 by
        default, whatever the files store). In a sharded build (several ranks, `model.load_sharded`) it is built on
        the meta device and `materialize` reads each rank's shards from the safetensors; where the directory's weight
        names do not map to the model's (or its family loads whole, see the registry), rank 0 loads it whole and
        scatters it."""
        dtype = DTYPES[self.config.parallel.master_dtype]
        if self._sharded_build:
            model = build_on_meta(directory, dtype)
            if not self.is_main or (family_of(model.config).sharded_load and loadable(model, directory)):
                return model
            logger.info("model.load_sharded: %s is not read shard by shard; rank 0 loads it whole", directory)
        return load_model(directory, dtype)

    def _set_attention(self, model: TrainableModel) -> None:
        """Apply `model.attn_implementation` (a ConfigError naming it where the model or the machine cannot run it)."""
        name = self.config.model.attn_implementation
        if name == "sdpa":
            return
        try:
            model.set_attn_implementation(name)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"model.attn_implementation {name!r}: {exc}") from exc

    def _set_experts(self, models: Sequence[TrainableModel]) -> None:
        """Apply `model.experts_implementation` to every model with experts (a ConfigError naming it where none has
        any, or transformers has no such implementation)."""
        from veomni_lite.models.pretrained import hf_child
        from veomni_lite.models.routing import routers

        name = self.config.model.experts_implementation
        with_experts = [model for model in models if routers(model)]
        if name and not with_experts:
            raise ConfigError(f"model.experts_implementation {name!r}: {type(models[0]).__name__} has no experts")
        for model in with_experts if name else ():
            try:
                hf_child(model)[1].set_experts_implementation(name)
            except (ImportError, ValueError) as exc:
                raise ConfigError(f"model.experts_implementation {name!r}: {exc}") from exc

    def _check_packing(self, model: TrainableModel) -> None:
        """`data.packing` needs a model that masks packed rows by `attention_sequence_ids` (a config error)."""
        if self.config.data.packing and ATTENTION_SEQUENCE_IDS not in inspect.signature(model.forward).parameters:
            raise ValueError(
                f"data.packing needs a model whose forward takes {ATTENTION_SEQUENCE_IDS!r} (the packed rows' "
                f"samples, for its attention mask); {type(model).__name__}.forward does not"
            )

    def _check_loss_weights(self, model: TrainableModel) -> None:
        """A head in seq-mean-token-mean needs a model that applies `<name>_loss_weights`: refuse one that would
        silently drop them (a config error on every rank alike: the model and config are the same everywhere)."""
        for key in self.loss_keys:
            weights = loss_weights_key(name_of_loss(key))
            if (
                self.loss_modes.mode(name_of_loss(key)) == "seq-mean-token-mean"
                and weights not in inspect.signature(model.forward).parameters
            ):
                raise ValueError(
                    f"loss mode seq-mean-token-mean for {key!r} needs a model whose forward takes {weights!r} "
                    f"(the per-token weights 1/n_s); {type(model).__name__}.forward does not"
                )

    # ------------------------------------------------------------------ hooks

    def trained_loss_keys(self, model: TrainableModel) -> tuple[str, ...]:
        """The loss keys each micro-batch's outputs carry (the model's own; a trainer that computes its loss from the
        model's logits names its own)."""
        return tuple(model.loss_keys)

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the sharded model: AdamW over `parameter_groups` (`build_optimizer`)."""
        return build_optimizer(self.model, self.config.optim)

    def make_scheduler(self) -> LambdaLR:
        """The optimizer's schedule: `optim.schedule` over the run (`build_scheduler`)."""
        return build_scheduler(self.optimizer, self.config.optim, self.max_steps)

    def on_model_built(self) -> None:  # noqa: B027 - a hook with nothing to do by default
        """Called once the model is sharded and filled, before the loader, the optimizer and any resume (e.g. to keep
        what the initial weights are). It may run forwards (every rank the same number: each is collective): the
        model is resharded before the optimizer takes its parameters."""

    def forward(self, micro_batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """One micro-batch's outputs: `{"<name>_loss": local mean}` for every loss key (and optionally `"metrics"`,
        see `MetricLogger`). Here: the model's own forward."""
        return self.model(**self.preforward(micro_batch))

    def metric_specs(self) -> list[MetricSpec]:
        """The trainer's own train metrics besides the loop's (see `MetricLogger`'s `extra_specs`)."""
        return []

    @property
    def metric_differences(self) -> dict[str, tuple[str, str]]:
        """Train metrics logged as the difference of two of `metric_specs`' means (`MetricLogger`'s `differences`)."""
        return {}

    @abstractmethod
    def build_model(self) -> TrainableModel:
        """The model to train, on the CPU; it keeps the `TrainableModel` contract. In a sharded build the ranks but
        rank 0 run it under `torch.device("meta")` (see `_build_model`), so its values must come from rank 0's call."""

    def materialize(self, model: torch.nn.Module) -> None:
        """Fill a model that `build_model` returned on the meta device on rank 0 too, now sharded and allocated
        (`to_empty`) on the device: each rank writes its own shards (collective). Here: `model.pretrained_dir`'s
        weights (`pretrained_model`); a subclass that builds other models on meta overrides it."""
        directory = self.config.model.pretrained_dir
        if not directory:
            raise NotImplementedError(
                f"{type(self).__name__}.build_model returned a meta-device model: implement materialize"
            )
        load_into_shards(model, directory)

    @abstractmethod
    def build_datasets(self) -> tuple[Any, Any | None]:
        """(train dataset, eval dataset or None): indexable, deterministic by seed."""

    @abstractmethod
    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Samples -> one micro-batch (labels shifted once, padded)."""

    @property
    def vocab_size(self) -> int:
        return self.train_dataset.vocab_size

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def label_limits(self) -> dict[str, int]:
        """Number of classes of every labels key other than `labels` (which uses the vocabulary size)."""
        return {}

    def build_metrics(self) -> MetricLogger:
        return MetricLogger(
            self.config.logging,
            self.parallel,
            loss_names=list(self.loss_keys),
            output_dir=self.output_dir,
            max_steps=self.max_steps,
            flops_per_token=self.flops_per_token,
            device=self.device,
            loss_modes=self.loss_modes,
            pad_id=self.pad_id,
            run_config=self.config.to_dict(),
            extra_specs=self.metric_specs() + (self.router.specs() if self.router is not None else []),
            plots=self.plots,
            differences=self.metric_differences,
        )

    # ------------------------------------------------------------------ data

    def _make_loader(
        self, dataset: Any, seed: int, prefetch_steps: int = 0, token_budget: bool = False
    ) -> MicroBatchLoader:
        """`token_budget`: micro-batches by `data.max_tokens_per_micro_batch`, read by `data.num_workers` worker
        processes (training only: evaluation keeps `train.micro_batch_size` samples per micro-batch, so every rank
        runs the same count, and reads in this process)."""
        return MicroBatchLoader(
            dataset,
            self.collate,
            self.config.train.global_batch_size,
            self.config.train.micro_batch_size,
            dp_size=self.parallel.dp_size,
            dp_rank=self.parallel.dp_rank,
            seed=seed,
            prefetch_steps=prefetch_steps,
            max_tokens=self.config.data.max_tokens_per_micro_batch if token_budget else 0,
            packing=self.config.data.packing,
            num_workers=self.config.data.num_workers if token_budget else 0,
            pin_memory=self.device.type == "cuda",
        )

    def shard(self, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`shard_micro_batch` with the run's loss modes, layout and pad id."""
        return shard_micro_batch(micro_batch, self.loss_modes, self.parallel, self.pad_id)

    def preforward(self, micro_batch: Mapping[str, Any]) -> dict[str, Any]:
        """`to_device` on the trainer's device for its model."""
        return to_device(micro_batch, self.device, self.model.host_inputs)

    def postforward(
        self,
        outputs: Mapping[str, torch.Tensor],
        micro_batch_token_len: Mapping[str, torch.Tensor],
        micro_batches_token_len: Mapping[str, torch.Tensor],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss to backpropagate, scaled per-key losses): VeOmni's hook, where loss normalization happens (memoized
        on the step's `LossStep`, whose `verify` reads the verdict)."""
        losses = {key: outputs[key] for key in self.loss_keys}
        memo = self.loss_step.memo
        scaled = mean_global_loss(
            losses, micro_batch_token_len, micro_batches_token_len, modes=self.loss_modes, memo=memo
        )
        return sum(scaled.values()), scaled

    # ------------------------------------------------------------------ control plane

    def _agree(self, micro_batches: list[dict[str, torch.Tensor]], failed: DataError | None = None) -> bool:
        """Validate this rank's data, then one MAX all-reduce on the CPU control group (stop, bad data, counts):
        bad data on any rank (or `failed`, the error this rank's loader raised instead of giving its micro-batches:
        a sample over the token budget, an image that does not decode) is a DataError on every rank naming each such
        rank and its cause. Under a token budget, `micro_batches` is then extended with padding micro-batches to the
        largest count.

        Returns whether every rank stops now: the agreed value, never this rank's own flag, which a signal may set
        after the all-reduce (that stop is agreed at the next step)."""
        problem: DataError | None = failed
        try:
            for index, micro_batch in enumerate(micro_batches):
                validate_micro_batch(
                    micro_batch,
                    self.vocab_size,
                    self.labeled_loss_keys,
                    self.label_limits,
                    where=f"micro-batch {index}",
                )
        except DataError as exc:
            problem = problem or exc
        count = len(micro_batches)
        flags = [int(self._stop_signal is not None), count, -count]
        stop, most, fewest = agree(problem, DataError, self.control_group, flags, where=f"step {self.step + 1}: ")
        if most != -fewest and self.config.data.max_tokens_per_micro_batch:
            # token-budget plans differ in count: run no-target micro-batches up to the longest plan
            micro_batches.extend(padding_micro_batch(micro_batches[0]) for _ in range(most - count))
        elif most != -fewest:
            raise DataError(
                f"rank {self.rank}: ranks disagree on the number of micro-batches at step {self.step + 1} "
                f"(this rank {count}, min {-fewest}, max {most}): a data source ended early on some rank"
            )
        if stop and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM
        return bool(stop)

    def _install_signal_handlers(self) -> dict[int, Any]:
        def request_stop(signum: int, _frame: Any) -> None:
            self._stop_signal = signum

        previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: no handlers
                previous[signum] = signal.signal(signum, request_stop)
        return previous

    # ------------------------------------------------------------------ the loop

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> None:
        """One optimizer step over this rank's micro-batches (already SP-sharded and agreed)."""
        step_start = time.perf_counter()
        lr = self.scheduler.get_last_lr()[0]  # the rate this step trains with
        self.loss_step = self._loss_step(micro_batches, train=True)
        last = len(micro_batches) - 1
        step_loss = torch.zeros((), device=self.device)
        for index, (micro_batch, micro_batch_token_len) in enumerate(self.loss_step):
            set_gradient_sync(self.model, index == last, self._sync_every_micro_batch)
            outputs = self._routed(micro_batch, self.forward)
            loss, _scaled = self.postforward(outputs, micro_batch_token_len, self.loss_step.tokens)
            loss.backward()
            step_loss = step_loss + loss.detach()
            self.metrics.record_micro_batch(outputs, micro_batch_token_len, micro_batch)

        grad_norm, bad_loss_ranks = clip_global_grad_norm(
            self.trainable, self.config.optim.max_grad_norm, step_loss, self.parallel.world_group
        )
        wait_start = time.perf_counter()
        self.metrics.wait_bookkeeping()  # the previous step's bookkeeping finishes before this update
        bookkeeping_wait = time.perf_counter() - wait_start
        self.loss_step.verify()
        norm, bad_loss_count = torch.stack([grad_norm.double(), bad_loss_ranks]).cpu().tolist()  # the one host read
        finite = math.isfinite(norm) and bad_loss_count == 0  # global values: every rank decides alike
        self.step += 1
        if finite:
            self.optimizer.step()
            self.scheduler.step()
        else:
            self._on_non_finite(norm, step_loss)
        self.optimizer.zero_grad(set_to_none=True)
        self.metrics.record_step(
            grad_norm.detach(),
            lr=lr,
            skipped=not finite,
            step_time=time.perf_counter() - step_start - bookkeeping_wait,
            bookkeeping_wait=bookkeeping_wait,
        )

    def _loss_step(self, micro_batches: list[dict[str, torch.Tensor]], train: bool) -> LossStep:
        """The step's `LossStep`, with the router heads' counts of an MoE model; `global-batch` (training): the
        expert counts of the step's f (its micro-batches' given routing, else the previous step's:
        `RouterLosses.step_slots`) in its one all-reduce, made now so every forward of the step has the f."""
        if self.router is None:
            return LossStep(micro_batches, self.loss_modes, marked=True)
        slots = self.router.step_slots(self.device, micro_batches) if train else None
        step = LossStep(micro_batches, self.loss_modes, marked=True, extra_counts=self.router.counts, slots=slots)
        if slots is not None:
            self.router.set_global_counts(step.step_slots(self.loss_keys))
        return step

    def _routed(
        self, micro_batch: dict[str, torch.Tensor], forward: Callable[[dict[str, torch.Tensor]], Mapping[str, Any]]
    ) -> Mapping[str, Any]:
        """`forward(micro_batch)`, plus the router heads of an MoE model (`RouterLosses.routed`)."""
        if self.router is None:
            return forward(micro_batch)
        return self.router.routed(self.model, micro_batch, forward)

    def _on_non_finite(self, norm: float, step_loss: torch.Tensor) -> None:
        """Every rank is here together (the verdict is global): name the ranks, then skip or raise alike."""
        losses = all_gather_objects(float(step_loss), self.parallel.world_group)  # host read: error path only
        bad = [rank for rank, value in enumerate(losses) if not math.isfinite(value)]
        where = f"loss non-finite on rank(s) {bad}: {[losses[r] for r in bad]}" if bad else "every loss finite"
        message = f"step {self.step}: non-finite values: global grad norm {norm}, {where}"
        if self.config.train.nonfinite == "error":
            raise NonFiniteError(f"rank {self.rank}, {message}; set train.nonfinite=skip to skip such steps")
        if self.is_main:
            logger.warning("%s; the step is skipped on every rank (train.nonfinite=skip)", message)

    def train(self) -> dict[str, float]:
        """Run until `self.max_steps` (`train.max_steps` or `train.epochs`); returns the last logged metrics. Every
        exit path flushes the metrics. With `evaluates_starting_weights` and evaluation on, a fresh run first evaluates
        the starting weights (logged at step 1, the step that trains them; steps count from 1)."""
        if self.evaluates_starting_weights and self.step == 0 and self.config.train.eval_interval:
            self.evaluate()
        train = self.config.train
        save_interval = self.config.checkpoint.save_interval
        previous_handlers = self._install_signal_handlers()
        progress = self._progress_bar()
        try:
            while self.step < self.max_steps:
                failed: DataError | None = None
                try:
                    micro_batches = [self.shard(mb) for mb in self.loader.next_step()]
                except DataError as exc:  # e.g. a sample over the token budget: agreed below like bad data
                    if getattr(exc, "agreed", False):  # every rank raised it already (`agree`)
                        raise
                    micro_batches, failed = [], exc
                epoch = self.loader.epoch
                if self._agree(micro_batches, failed):
                    self._on_interrupt()
                self.train_step(micro_batches)
                self.epoch = epoch
                if self.router is not None and self.metrics.should_log(self.step):  # the window's expert loads
                    group = self.parallel.world_group
                    imbalance = write_loads(self.router, self.step, self.output_dir, group, self.is_main)
                    if imbalance is not None:
                        self.metrics.train.record(LOAD_IMBALANCE, imbalance)
                self.metrics.end_step(self.step, self.epoch, release=micro_batches)
                del micro_batches
                if progress is not None:
                    progress.update(1)
                    progress.set_postfix_str(self.metrics.postfix(), refresh=False)
                if train.eval_interval and self.step % train.eval_interval == 0:
                    self.evaluate()
                if save_interval and self.step % save_interval == 0:
                    self.save_checkpoint()
            if self._saved_step != self.step:  # decided from shared state, never from a rank-local file check
                self.save_checkpoint()
            return self.metrics.finish(self.step, self.epoch)
        except (DataError, NonFiniteError, LossKeyMismatchError):
            self.metrics.finish(self.step, self.epoch)  # every rank raised at the same point: a collective is safe
            raise
        except BaseException:
            self.metrics.abort(self.step)
            raise
        finally:
            if progress is not None:
                progress.close()
            for signum, handler in previous_handlers.items():
                signal.signal(signum, handler)
            self.loader.close()

    def _progress_bar(self) -> Any:
        if not (self.is_main and progress_bar_shown(self.config.logging)):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.max_steps, initial=self.step, desc="train", dynamic_ncols=True)

    def _on_interrupt(self) -> None:
        signum = self._stop_signal or signal.SIGTERM
        if self.config.checkpoint.save_on_interrupt and self.step > 0 and self._saved_step != self.step:
            self.save_checkpoint()  # logs the open window first
        self.metrics.finish(self.step, self.epoch)
        raise TrainingInterrupted(128 + int(signum))

    # ------------------------------------------------------------------ eval

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The one eval loop: eval losses (each head's loss mode, per eval step, averaged over `train.eval_batches`
        steps), `eval/<name>` for every `eval_metric_names` entry (its (total, count) summed over the micro-batches
        and ranks) and `extra_eval_metrics`, logged under eval/. Each eval step is a `_loss_step` (a subclass's
        pass before the forwards included) and each forward the trainer's own `forward`."""
        if self.eval_dataset is None or self.config.train.eval_batches == 0:
            return {}
        was_training = self.model.training
        self.model.eval()
        loader = self._make_loader(self.eval_dataset, self.config.train.seed + 1)
        batches, names = self.config.train.eval_batches, self.eval_metric_names
        totals: dict[str, torch.Tensor] = {}
        sums = torch.zeros(len(names), 2, dtype=torch.float64)
        try:
            for number in range(batches):
                step = self._loss_step(self.eval_micro_batches(loader, number), train=False)
                for micro_batch, tokens in step:
                    outputs = self._routed(micro_batch, self.forward)
                    scaled = step.scaled({key: outputs[key] for key in self.loss_keys}, tokens)
                    for key, value in scaled.items():
                        totals[key] = totals.get(key, 0) + value.detach() / batches
                    for index, name in enumerate(names):
                        total, count = outputs["metrics"][name]
                        sums[index] += torch.tensor([float(total), float(count)], dtype=torch.float64)
        finally:
            loader.close()
        extra = self._eval_metric_means(names, sums) if names else {}
        extra |= self.extra_eval_metrics()
        self.model.train(was_training)
        return self.metrics.log_eval(self.step, self.epoch, totals, extra)

    @property
    def eval_metric_names(self) -> tuple[str, ...]:
        """The `outputs["metrics"]` entries ({name: (total, count)}) evaluation logs as `eval/<name>` = their total /
        count over every eval micro-batch and rank (a subclass hook; none here)."""
        return ()

    def _eval_metric_means(self, names: Sequence[str], sums: torch.Tensor) -> dict[str, float]:
        """Collective: `eval/<name>` of each (total, count) row of `sums` summed over the ranks (one all-reduce), and
        `metric_differences` among them where both sides counted anything."""
        reduced = all_reduce(sums.flatten().tolist(), op="sum", group=self.control_group)
        totals, counts = dict(zip(names, reduced[::2])), dict(zip(names, reduced[1::2]))
        extra = {f"eval/{name}": totals[name] / max(counts[name], 1.0) for name in names}
        for name, (a, b) in self.metric_differences.items():
            if counts.get(a) and counts.get(b):
                extra[f"eval/{name}"] = extra[f"eval/{a}"] - extra[f"eval/{b}"]
        return extra

    def eval_micro_batches(self, loader: Any, number: int) -> list[dict[str, torch.Tensor]]:
        """Collective: this rank's micro-batches of eval batch `number` (read, collated, sharded and validated), agreed
        as `agreed_micro_batches` says (the eval loader plans `train.micro_batch_size` samples each, the same count on
        every rank)."""

        def read() -> list[dict[str, torch.Tensor]]:
            micro_batches = [self.shard(mb) for mb in loader.next_step()]
            for index, micro_batch in enumerate(micro_batches):
                validate_micro_batch(
                    micro_batch,
                    self.vocab_size,
                    self.labeled_loss_keys,
                    self.label_limits,
                    where=f"micro-batch {index}",
                )
            return micro_batches

        return self.agreed_micro_batches(read, f"evaluation at step {self.step}, eval batch {number + 1}: ")

    def agreed_micro_batches(
        self, read: Callable[[], list[dict[str, torch.Tensor]]], where: str
    ) -> list[dict[str, torch.Tensor]]:
        """Collective: `read()`'s micro-batches once every rank has its own, for a pass that runs a forward per
        micro-batch outside a train step: ONE MAX all-reduce on the control group (an error flag and the count) before
        the first forward. Any exception in `read` (a bad row, a collate error: data met by this rank only) is a
        DataError on every rank naming each such rank and its cause, so no rank is left waiting in a forward's
        collectives; ranks with different micro-batch counts too."""
        problem: Exception | str | None = None
        micro_batches: list[dict[str, torch.Tensor]] = []
        try:
            micro_batches = read()
        except Exception as exc:  # noqa: BLE001 - agreed below, then raised on every rank
            if getattr(exc, "agreed", False):  # every rank raised it already (`agree`)
                raise
            problem = data_problem(exc, f"rank {self.rank}: {where}")
        count = len(micro_batches)
        most, fewest = agree(problem, DataError, self.control_group, [count, -count], where)
        if most != -fewest:
            raise DataError(f"{where}ranks disagree on the number of micro-batches (min {-fewest}, max {most})")
        return micro_batches

    def extra_eval_metrics(self) -> dict[str, float]:
        """Task metrics logged under eval/ next to the eval losses, the same value on every rank (a subclass hook;
        every rank calls it at the same point, so it may run collectives)."""
        return {}

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path:
        """Collective. The open metric window is logged first, so the checkpoint holds none (see MetricLogger)."""
        metrics_state = self.metrics.checkpoint_state(self.step, self.epoch)
        trainer_state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            # One global batch per optimizer step; an interrupt may have fetched the next one already.
            "loader": {**self.loader.state_dict(), "step": self.step},
            "metrics": metrics_state,
            "config": self.config.to_dict(),
        }
        if self.router is not None:  # global-batch: the last step's expert counts (a collective, on every rank)
            trainer_state["moe"] = self.router.state_dict(self.parallel.world_group, self.is_main)
        rank_state = {"rng": rng_state()}
        path = self.checkpoints.save(self.step, self.model, self.optimizer, trainer_state, rank_state)
        self._saved_step = self.step
        return path

    def _resume(self) -> None:
        found = self.checkpoints.agreed_checkpoints()  # rank 0's listing: every rank decides alike
        if not found:
            if self.is_main:
                logger.info("checkpoint.resume: no checkpoint under %s, starting fresh", self.checkpoints.root)
            return
        loaded = self.checkpoints.load_latest(
            self.model,
            self.optimizer,
            on_skip=self._warn,
            model_settings=model_settings_of(self.config.to_dict()),
            checkpoints=found,
        )
        if loaded is None:
            raise CheckpointError(
                f"checkpoint.resume: no checkpoint under {self.checkpoints.root} could be loaded "
                f"(tried {[str(p) for _, p in found]})"
            )
        step, trainer_state, rank_state = loaded
        self.step = self._saved_step = step
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        self.loader.load_state_dict(trainer_state["loader"])
        self.epoch = self.loader.epoch
        self.metrics.load_state_dict(trainer_state["metrics"], step)
        if self.router is not None:
            self.router.load_state_dict(trainer_state.get("moe", {}), self.is_main)
        if rank_state is not None:
            set_rng_state(rank_state["rng"])
        if self.is_main:
            logger.info("resumed from %s at step %d", self.checkpoints.step_dir(step), step)

    def _warn(self, message: str) -> None:
        if self.is_main:
            logger.warning(message)

    def close(self) -> None:
        """Stop the prefetch thread, tear down the process group (idempotent)."""
        self.loader.close()
        self.metrics.close()
        destroy_process_groups()
