"""The run configuration's sections: one dataclass per concern, each field documented where it is declared.

`model` (which model), `data` (the training data), `train` (steps, batches, eval, outputs), `parallel` (layout,
precision, collective timeout), `optim` (AdamW and its schedule), `checkpoint`, `logging`, `loss` (modes) and
`example` (what only the examples read), gathered in `Config`, and an entry point's own sections as fields of a
subclass (`config_class`); a section's field may be a section itself (`rl.critic`). `ALIASES` keeps the old names
(`train.lr`, `model.hidden_size`, ...). Reading them (YAML, overrides, checks) is `veomni_lite.config`, which every
caller imports these names from.
"""

from __future__ import annotations

import functools
import os
import typing
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist
import yaml

from veomni_lite.utils.loss_utils import LossModes


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending key."""


@dataclass
class ModelConfig:
    """Which model: the tiny example models (their sizes in the `example` section), or a transformers architecture
    built from `hf` or read from `pretrained_dir`."""

    arch: str = "tiny"
    """tiny: the example models (sized by the `example` section); a model_type of a family in
    `veomni_lite.models.registry` (qwen2_vl, qwen2_5_vl, qwen3_vl, or any transformers causal LM: qwen2, llama, ...);
    auto: whatever `pretrained_dir` holds (trainers/train_sft.py)."""
    hf: dict[str, Any] = field(default_factory=dict)
    """transformers config fields for qwen2 / qwen2_vl (`model_type` included for qwen2; `text_config` and
    `vision_config` for qwen2_vl); the vocabulary and special-token ids come from the run's tokenizer. Override one
    field as `--model.hf.hidden_size 128`."""
    pretrained_dir: str = ""
    """A local `from_pretrained` directory (config, weights, tokenizer; for Qwen2-VL its image processor) to start from
    instead of `hf`; its own tokenizer is used. Loaded with trust_remote_code=False (nothing is downloaded)."""
    load_sharded: bool = True
    """On several ranks, build the model on the meta device and fill only each rank's shards after `fully_shard`:
    a pretrained model's shards read straight from its safetensors (no rank holds the whole model); a model built
    from a config built whole on rank 0 only, on the CPU, and scattered (its values are a whole build's). No device
    holds the whole model. false: every rank builds or loads the whole model first."""
    lora: dict[str, Any] = field(default_factory=dict)
    """LoRA: `{rank, alpha, dropout, target_modules}` trains low-rank adapters on the listed Linear layers of
    `pretrained_dir`'s model (module names such as `[q_proj, v_proj]`, `*` globs, or `all-linear`, the default: every
    Linear but the output head; a vision tower only where an entry names it, e.g. `visual.*.qkv`), the base frozen
    (no gradients, no optimizer state, not in the checkpoints). `alpha` defaults to the rank, `dropout` to 0. The
    adapters and their AdamW state are float32; the frozen base keeps `parallel.master_dtype` (bf16 halves it and,
    as nothing updates it, rounds no update away). `{}` (the default) or `{rank: 0}`: every weight trains."""
    attn_implementation: str = "sdpa"
    """The transformers decoder's attention: sdpa, or flash_attention_2 / flash_attention_3 where the package is
    installed (a GPU); packed rows then reach flash-attention's varlen kernel as host-computed boundaries. Under
    `parallel.sp_size` > 1 the same attention runs after Ulysses' all-to-all (SDPA or the varlen kernel over the whole
    row). Vision towers keep sdpa."""
    experts_implementation: str = ""
    """A mixture of experts' expert kernels (transformers' `experts_implementation`): eager (a loop over the experts
    hit), batched_mm, grouped_mm (torch's grouped GEMM; float32 / bf16 only), or another transformers registers;
    empty: transformers' default (grouped_mm where it runs, else eager). A model without experts refuses one."""
    fused_lm_head: bool = True
    """The transformers models (Qwen2, Qwen2-VL, any causal LM of `pretrained_dir`): compute the LM head's matmul and
    its cross-entropy chunk by chunk of tokens, so the [tokens, vocab] logits and their gradient are never whole in
    memory (the same losses and gradients, every loss mode); false: build the logits whole first. The tiny example
    models always build theirs."""


@dataclass
class DataConfig:
    """The training data: the files, how their rows read and how samples are batched, packed and cached."""

    pad_to_multiple_of: int = 1
    """Round each micro-batch's length up to a multiple of this."""
    eval_fraction: float = 0.2
    """The held-out share of the corpus, the images, or (SFT without `eval_path`) the rows; SFT holds none out when
    the run does not evaluate (`train.eval_interval` or `train.eval_batches` 0)."""
    train_path: list[str] = field(default_factory=list)
    """SFT: the training data: files (.jsonl, .json, .parquet, .arrow), `save_to_disk` directories, directories of
    files, or globs; one or a list."""
    eval_path: list[str] = field(default_factory=list)
    """SFT: the held-out data, as `train_path`; empty: `eval_fraction` of the training rows."""
    format: Literal["messages", "sharegpt", "alpaca", "prompt_completion", "text", "preference"] = "messages"
    """SFT: how a row holds its conversation (see `veomni_lite.data.sft`); `preference`: chosen / rejected pairs, for
    `trainers/train_preference.py` (see `veomni_lite.preference.pairs`)."""
    columns: dict[str, Any] = field(default_factory=dict)
    """SFT: column and role names where a dataset differs, e.g. `{conversations: dialog, user_tag: user}`."""
    media_dir: str = ""
    """SFT: the directory image paths are relative to (default: each data file's own directory)."""
    chat_template: str = ""
    """SFT: empty for the tokenizer's own chat template; `chatml`, or a Jinja template."""
    train_on_prompt: bool = False
    """SFT: train on every token, not only the assistant turns (image placeholders never train)."""
    max_seq_len: int = 2048
    """SFT: the longest sample, in tokens (image placeholders included); 0: no limit."""
    overlength: Literal["truncate", "drop", "error"] = "truncate"
    """SFT: what a longer sample gets (the counts are logged)."""
    packing: bool = False
    """Concatenate each micro-batch's samples into one row (positions restart per sample, attention never crosses a
    sample, the step trains exactly as unpacked); for the transformers models (SFT, Qwen2-VL digits)."""
    shared_prefix: bool = True
    """Packed text rows keep once the untrained first tokens consecutive samples share (an RL group's prompt, a
    preference pair's prompt, a common system prompt): one forward over them instead of one per sample, the same
    values and gradients (see `veomni_lite.data.collator`); SDPA attention only (flash-attention packs without it)."""
    max_tokens_per_micro_batch: int = 0
    """Token budget: each rank splits its share of the step's samples into as few micro-batches as fit this many
    tokens (packed: their sum; padded: rows x longest), instead of `train.micro_batch_size` samples each; 0: off. A
    longer sample (a preference pair: both sides packed, two rows of the longer padded) gets `overlength`."""
    prefetch_steps: int = -1
    """Steps of micro-batches read, processed and collated ahead on a background thread while the current step trains;
    0: none; -1: 1 on an accelerator (the device computes meanwhile), 0 on a CPU-only machine, where the thread
    competes with the compute (`make bench` measures both)."""
    sources: list[dict[str, Any]] = field(default_factory=list)
    """SFT: weighted sources instead of `train_path`: `[{path, format, weight, columns, media_dir}]` (path as
    `train_path`; format, columns and media_dir default to the keys above; weight 1). An epoch draws round(weight x
    samples) of each source (see `veomni_lite.data.mixture`); `eval_fraction` holds out that share of every source."""
    cache_dir: str = ""
    """SFT and preference pairs: where the preprocessed samples are kept (memory-mapped Arrow, one directory per
    fingerprint of everything that changes a sample; later runs and resumes read it; the precomputed preference
    reference too); empty: `<train.output_dir>/data_cache`. Every rank must see it (a shared file system); point
    several runs at one directory to share the work."""
    num_workers: int = 0
    """DataLoader worker processes that read, decode and process (images) and collate the training micro-batches
    ahead of the step (pinned memory on an accelerator); 0: in the trainer's process. The batches are the same."""
    streaming: bool = False
    """SFT: read `train_path` in file order while training, without the cache, for a set that does not fit on disk
    twice (see `veomni_lite.data.streaming`): every rank reads and tokenizes every row, the global batches are the
    same on every layout, and a checkpoint holds the stream's position (an exact resume). Gives up a global shuffle
    (only within `shuffle_window`) and a known epoch length: needs `train.max_steps` (not `train.epochs`) and, to
    evaluate, `eval_path` (no `eval_fraction`); no weighted `sources`, no `num_workers`."""
    shuffle_window: int = 1000
    """SFT streaming: rows read, encoded and shuffled together (each window permuted by the seed, the epoch and
    where it starts; samples never move across windows); 1: file order. Every rank holds one window's samples."""


@dataclass
class ExampleConfig:
    """The settings only the examples read (`examples/`: the tiny models, the synthetic and help-page datasets); their
    old names `model.<name>` and `data.<name>` keep working (`ALIASES`). The examples check them
    (`examples.settings.check_example`)."""

    hidden_size: int = 64
    """Width of the decoder."""
    num_layers: int = 2
    """Decoder blocks (each is one FSDP unit)."""
    num_heads: int = 4
    """Attention heads; `parallel.sp_size` must divide it (Ulysses splits heads)."""
    intermediate_size: int = 176
    """Width of the SwiGLU feed-forward."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    image_size: int = 16
    """VLM: side of the square input image, in pixels."""
    patch_size: int = 4
    """VLM: side of a square patch; must divide `image_size`."""
    num_samples: int = 4096
    """Training samples (the loader drops a trailing partial global batch each epoch)."""
    eval_samples: int = 64
    """Held-out samples; 0 disables eval."""
    generation_ratio: float = 0.5
    """VLM: fraction of samples that are caption -> image codes (the rest are image -> caption)."""
    seq_len: int = 128
    """qwen2 text: tokens per sample."""
    tokenizer_vocab_size: int = 2048
    """qwen2 text: the BPE vocabulary trained on the corpus (saved as output_dir/tokenizer.json)."""


EXAMPLE_MODEL_FIELDS = ("hidden_size", "num_layers", "num_heads", "intermediate_size", "rope_theta", "image_size",
                        "patch_size")  # fmt: skip
EXAMPLE_DATA_FIELDS = ("num_samples", "eval_samples", "generation_ratio", "seq_len", "tokenizer_vocab_size")


@dataclass
class TrainConfig:
    """The run: what is trained, for how long, on which batches, and where its outputs go."""

    micro_batch_size: int = 4
    """Samples per micro-batch on each data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step over all ranks; gradient accumulation = global / (micro x dp)."""
    max_steps: int = 100
    """Optimizer steps of the whole run (a resumed run continues to this step); 0 when `epochs` sets the length."""
    epochs: int = 0
    """Epochs of the training samples instead of `max_steps` (0: off): the run trains epochs x (training samples //
    global_batch_size) steps, the loader's epoch (it drops a trailing partial global batch), counted once the data is
    built and logged at start. `max_steps` and `epochs` are alternatives: the one a YAML or the command line sets
    replaces the other's default; both nonzero is an error."""
    eval_interval: int = 0
    """Evaluate every this many steps (0: never)."""
    eval_batches: int = 2
    """Global batches per evaluation (0: no evaluation)."""
    nonfinite: Literal["error", "skip"] = "error"
    """A non-finite loss on any rank or a non-finite global grad norm: raise on every rank, or skip the step on all."""
    output_dir: str = "outputs/run"
    """Where metrics.jsonl, tensorboard/, loss_curve.png, checkpoints/ and config.yaml go."""
    seed: int = 42
    """Seeds the model init and the data order (the same on every layout)."""


@dataclass
class ParallelConfig:
    """How the world is laid out: dp = world size / sp_size, and how long a collective may wait."""

    sp_size: int = 1
    """Ulysses sequence-parallel degree; must divide the world size and the attention heads."""
    dp_replicate: int = 1
    """HSDP: parameters are sharded within blocks of world / dp_replicate consecutive ranks and replicated across the
    blocks (set it to the number of nodes to shard within each node). 1: plain FSDP over every rank. Must divide the
    dp size (world / sp_size)."""
    ep_size: int = 1
    """Expert parallelism: each MoE layer's routed experts sharded over groups of ep_size consecutive ranks (carved
    from the dp x sp ranks), tokens sent to their experts' ranks and back by all-to-all; 1: FSDP2 alone. Must divide
    the world size (dp x sp) / dp_replicate and every MoE layer's number of experts (docs/moe.md, "Expert
    parallelism")."""
    gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = "every_micro_batch"
    """Under gradient accumulation: every_micro_batch reduce-scatters each micro-batch's gradients, so only sharded
    gradients are kept (the memory-safe choice, torchtitan's default; HSDP's replica all-reduce still runs once per
    step); last_micro_batch keeps whole unsharded gradients until the step's last micro-batch, one reduction per
    step for a model's worth of extra memory."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (less memory, more compute)."""
    mixed_precision: Literal["auto", "fp32", "bf16"] = "auto"
    """The compute dtype. auto: bf16 parameters in forward and backward with fp32 gradient reduction on CUDA, fp32
    elsewhere. The stored (master) parameters keep `master_dtype`."""
    master_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype of the trained parameters of a `model.pretrained_dir`, their gradients and AdamW's moments, whatever
    the directory stores (bf16 releases included). bf16 halves that memory, but an update smaller than half a bf16
    step of a weight (about 0.4% of its value) is rounded away: at fine-tuning learning rates most are."""
    collective_timeout_s: float = 300.0
    """Every process group's timeout: a collective one rank never joins fails with CollectiveError after this."""


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (see `veomni_lite.trainer.lr_schedule`)."""

    lr: float = 3e-3
    """Peak learning rate."""
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """After the linear warmup: cosine (a half-cosine down to lr x min_lr_ratio at the end of the run), linear (a
    straight line down to it), constant (the peak), wsd (warmup-stable-decay: the peak, then a linear decay to it over
    the last `decay_ratio` of the steps)."""
    min_lr_ratio: float = 0.1
    """The cosine, linear and wsd decays end at lr x min_lr_ratio, the rate after the last step."""
    warmup_steps: int = 10
    """Steps of linear warmup (step s, counted from 1, trains with lr x s / warmup_steps)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the run's steps, ceil(warmup_ratio x steps), instead of `warmup_steps` (0: off). The
    two are alternatives: the one a YAML or the command line sets replaces the other's default; both nonzero is an
    error."""
    decay_ratio: float = 0.1
    """wsd: the fraction of the run's steps, ceil(decay_ratio x steps), that the final decay takes."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    weight_decay_on: Literal["matrices", "all"] = "matrices"
    """matrices: weight matrices only (no biases, norms or embeddings, what users expect); all: every parameter."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's (beta1, beta2): the decay rates of the gradient's running mean and running square, e.g. [0.9, 0.95]."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the root of the running square."""
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """AdamW's kernels: auto is torch's own choice (foreach on CUDA, for_loop on CPU); fused (one kernel for all the
    parameters, on CUDA and CPU), foreach (batched tensor ops) or for_loop (per parameter)."""
    max_grad_norm: float = 1.0
    """Clip to this global gradient norm (0: no clipping; the norm is still logged)."""


@dataclass
class CheckpointConfig:
    """DCP checkpoints under output_dir/checkpoints."""

    save_interval: int = 0
    """Save every this many steps (0: only at the end and on interrupt)."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (the oldest are deleted)."""
    save_on_interrupt: bool = True
    """SIGTERM/SIGINT saves a checkpoint before exiting."""
    resume: bool = False
    """Continue from the newest loadable checkpoint."""


@dataclass
class LoggingConfig:
    """Metric windows and where they are written."""

    log_interval: int = 10
    """Log every this many steps (the final step is always logged)."""
    progress_bar: bool = True
    """A tqdm bar on rank 0 when stderr is a terminal (in a log file, the console's line per `log_interval`)."""
    tensorboard: bool = True
    """Write output_dir/tensorboard."""
    wandb: bool = False
    """Also log to Weights & Biases under output_dir/wandb (pip install -e .[wandb]); offline unless WANDB_MODE says
    otherwise."""
    wandb_project: str = "veomni_lite"
    """The W&B project name."""
    plot: bool = True
    """Redraw output_dir/loss_curve.png at a log, at most once every 30 s (and at the end of the run)."""
    async_step_end: bool = True
    """Reduce and write metrics on a worker thread, overlapping the next step."""
    peak_tflops: float = 0.0
    """Per-device peak for train/mfu; 0 looks up known GPUs (none on CPU)."""


LossModeName = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"
]


@dataclass
class LossConfig:
    """How each loss head is normalized over the optimizer step (see `veomni_lite.utils.loss_utils`)."""

    mode: LossModeName = "token-mean"
    """Every head's mode: token-mean (sum / valid tokens), seq-mean-token-mean (mean over sequences of each sequence's
    token mean), seq-mean-token-sum (mean over sequences of each sequence's sum), seq-mean-token-sum-norm (sum /
    (sequences x scale_factor)), token-sum (sum)."""
    modes: dict[str, Any] = field(default_factory=dict)
    """One head's mode, overriding `mode`: `--loss.modes.image_decoder token-sum`."""
    scale_factor: float = 0.0
    """C of seq-mean-token-sum-norm (required there, never taken from the batch); 0 = unset."""

    def resolved(self) -> LossModes:
        """The `LossModes` the loss module takes (raises ValueError on a bad mode or a missing scale factor)."""
        return LossModes(self.mode, dict(self.modes), self.scale_factor or None)


@dataclass
class MoEConfig:
    """Router losses of a Mixture-of-Experts decoder (see `veomni_lite.models.moe`); ignored for a dense model."""

    aux_loss_coef: float | None = None
    """The load-balancing head's coefficient (`router_aux`); None: the model config's `router_aux_loss_coef`."""
    z_loss_coef: float = 0.0
    """The router z-loss head's coefficient (`router_z`); 0: no z-loss."""
    balance: Literal["micro-batch", "global-batch", "sequence"] = "micro-batch"
    """Over which tokens the load balance is measured: micro-batch (transformers' loss per micro-batch, averaged over
    the step's micro-batches: what HF and TRL train, the default so a run matches them), global-batch (every token of
    the optimizer step, f one step late), sequence (DeepSeek-V3's per-sample loss)."""


@dataclass
class Config:
    """All sections; YAML files and `--section.key VALUE` overrides fill it (see `load_config`). An entry point's own
    sections (`rl`, `pref`) are typed fields of a subclass (`config_class`)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    example: ExampleConfig = field(default_factory=ExampleConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def sections(self) -> dict[str, Any]:
        """The entry point's own sections (`config_class`), e.g. `{"rl": RLConfig(...)}`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _SECTIONS}

    @property
    def world_size(self) -> int:
        """The initialized process group's size, else torchrun's WORLD_SIZE (read before any process group)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def dp_size(self) -> int:
        return self.world_size // self.parallel.sp_size

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.dp_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its sections' classes, so a `config_class` subclass comes back as itself."""
        own = tuple((name, type(value)) for name, value in self.sections.items())
        return _restore, (own, dict(self.__dict__))


@functools.cache
def config_class(sections: tuple[tuple[str, type], ...] = ()) -> type[Config]:
    """`Config` with an entry point's own sections as typed fields, e.g. `(("rl", RLConfig),)` -> a `Config` whose
    `rl` is an `RLConfig` (one class per set of sections)."""
    if not sections:
        return Config
    for name, _ in sections:
        if name in _SECTIONS:
            raise ValueError(f"section {name!r} is one of the shared sections {sorted(_SECTIONS)}")
    own = [(name, cls, field(default_factory=cls)) for name, cls in sections]
    return make_dataclass("Config", own, bases=(Config,), namespace={"__module__": __name__})


def _restore(sections: tuple[tuple[str, type], ...], state: dict[str, Any]) -> Config:
    config = object.__new__(config_class(sections))
    config.__dict__.update(state)
    return config


_SECTIONS: dict[str, type] = typing.get_type_hints(Config)  # the shared sections: {name: class}
# Before the sections were grouped by concern, every run setting lived under `train`, and the examples' settings under
# `model` and `data`: those names keep working.
ALIASES: dict[str, str] = {
    **{
        f"train.{f.name}": f"{section}.{f.name}"
        for section in ("parallel", "optim", "checkpoint", "logging")
        for f in fields(_SECTIONS[section])
    },
    **{f"model.{name}": f"example.{name}" for name in EXAMPLE_MODEL_FIELDS},
    **{f"data.{name}": f"example.{name}" for name in EXAMPLE_DATA_FIELDS},
}
