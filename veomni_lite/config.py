"""Run configuration: dataclasses for `model`, `data`, `train`, read from YAML plus dotted CLI overrides.

`load_config(path, ["--train.max_steps", "7"])` -> Config. Every problem (unknown section or key, a value of the
wrong type, a layout that does not fit the world size) raises ConfigError naming the key, before any process group
exists. `world_size` is read from the `WORLD_SIZE` environment variable torchrun sets (1 without torchrun), or from
the process group when one is already initialized.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending key."""


@dataclass
class ModelConfig:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 176
    rope_theta: float = 10000.0
    image_size: int = 16
    patch_size: int = 4


@dataclass
class DataConfig:
    num_samples: int = 4096
    eval_samples: int = 64
    generation_ratio: float = 0.5
    pad_to_multiple_of: int = 1


@dataclass
class TrainConfig:
    sp_size: int = 1
    micro_batch_size: int = 4
    global_batch_size: int = 16
    max_steps: int = 100
    log_interval: int = 10
    save_interval: int = 0
    eval_interval: int = 0
    eval_batches: int = 2
    output_dir: str = "outputs/run"
    resume: bool = False
    seed: int = 42
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    mixed_precision: str = "auto"
    nonfinite: str = "error"
    save_on_interrupt: bool = True
    keep_checkpoints: int = 2
    async_step_end: bool = True
    collective_timeout_s: float = 300.0
    progress_bar: bool = True
    peak_tflops: float = 0.0  # per device, for train/mfu; 0 = look up known GPUs, none on CPU
    tensorboard: bool = True
    plot: bool = True


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def world_size(self) -> int:
        """The initialized process group's size, else torchrun's WORLD_SIZE (read before any process group)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def dp_size(self) -> int:
        return self.world_size // self.train.sp_size

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.dp_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig}
_CHOICES = {"train.mixed_precision": ("auto", "fp32", "bf16"), "train.nonfinite": ("error", "skip")}


def _field_type(section_cls: type, name: str) -> Any:
    return typing.get_type_hints(section_cls)[name]


def _coerce(key: str, value: Any, expected: type) -> Any:
    """Check `value` against the field type (bool, int, float or str); strings from the CLI are parsed as YAML."""
    if isinstance(value, str) and expected in (int, float):
        with contextlib.suppress(ValueError):
            return expected(value)  # "1e-3" is a float here, although YAML 1.1 reads it as a string
    if isinstance(value, str) and expected is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse {value!r}: {exc}") from None
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is bool and isinstance(value, bool):
        return value
    if expected is int and is_number and isinstance(value, int):
        return value
    if expected is float and is_number:
        return float(value)
    if expected is str and (isinstance(value, str) or is_number):
        return str(value)
    raise ConfigError(f"{key}: expected {expected.__name__}, got {value!r} ({type(value).__name__})")


def _set(config: Config, dotted: str, value: Any, source: str) -> None:
    section, _, name = dotted.partition(".")
    if section not in _SECTIONS or not name:
        raise ConfigError(f"{source}: unknown config key {dotted!r}; sections are {sorted(_SECTIONS)}")
    section_cls = _SECTIONS[section]
    known = {f.name for f in fields(section_cls)}
    if name not in known:
        raise ConfigError(f"{source}: unknown config key {dotted!r}; {section} has {sorted(known)}")
    try:
        coerced = _coerce(dotted, value, _field_type(section_cls, name))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    setattr(getattr(config, section), name, coerced)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`["--train.max_steps", "7", "--train.resume=true"]` -> [("train.max_steps", "7"), ("train.resume", "true")]."""
    pairs: list[tuple[str, str]] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if not arg.startswith("--"):
            raise ConfigError(f"command line: expected --section.key VALUE, got {arg!r}")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if index + 1 >= len(args):
                raise ConfigError(f"command line: {arg} needs a value")
            index += 1
            value = args[index]
        pairs.append((key, value))
        index += 1
    return pairs


def validate(config: Config, world_size: int | None = None) -> None:
    """Cross-field checks; raise ConfigError naming the key."""
    world_size = config.world_size if world_size is None else world_size
    train = config.train
    for key, choices in _CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
    positive = {
        "train.sp_size": train.sp_size,
        "train.micro_batch_size": train.micro_batch_size,
        "train.global_batch_size": train.global_batch_size,
        "train.max_steps": train.max_steps,
        "train.log_interval": train.log_interval,
        "train.keep_checkpoints": train.keep_checkpoints,
        "model.num_heads": config.model.num_heads,
        "model.num_layers": config.model.num_layers,
        "model.hidden_size": config.model.hidden_size,
        "data.num_samples": config.data.num_samples,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    for key in ("train.save_interval", "train.eval_interval", "train.warmup_steps", "train.eval_batches"):
        if getattr(train, key.split(".")[1]) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {getattr(train, key.split('.')[1])}")
    if train.lr <= 0:
        raise ConfigError(f"train.lr: must be > 0, got {train.lr}")
    if config.model.hidden_size % config.model.num_heads:
        raise ConfigError(
            f"model.hidden_size ({config.model.hidden_size}) is not divisible by model.num_heads "
            f"({config.model.num_heads})"
        )
    if config.model.num_heads % train.sp_size:
        raise ConfigError(
            f"train.sp_size ({train.sp_size}) does not divide model.num_heads ({config.model.num_heads}): "
            "Ulysses attention splits heads across the sp group"
        )
    if world_size % train.sp_size:
        raise ConfigError(f"train.sp_size ({train.sp_size}) does not divide the world size ({world_size})")
    dp_size = world_size // train.sp_size
    per_step = train.micro_batch_size * dp_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) is not divisible by train.micro_batch_size "
            f"({train.micro_batch_size}) x dp size ({dp_size} = world {world_size} / sp {train.sp_size})"
        )
    if config.model.image_size % config.model.patch_size:
        raise ConfigError(
            f"model.image_size ({config.model.image_size}) is not divisible by model.patch_size "
            f"({config.model.patch_size})"
        )


def load_config(path: str | Path | None, overrides: list[str] | None = None, world_size: int | None = None) -> Config:
    """Defaults <- YAML file <- dotted overrides, then `validate`."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
        for section, values in data.items():
            if section not in _SECTIONS:
                raise ConfigError(f"{path}: unknown config section {section!r}; sections are {sorted(_SECTIONS)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping, got {type(values).__name__}")
            for name, value in values.items():
                _set(config, f"{section}.{name}", value, str(path))
    for key, value in parse_overrides(overrides or []):
        _set(config, key, value, "command line")
    validate(config, world_size)
    return config


def replace(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of `config` with some section fields replaced, e.g. `replace(cfg, train={"max_steps": 3})`."""
    new = Config(**{name: dataclasses.replace(getattr(config, name)) for name in _SECTIONS})
    for section, values in sections.items():
        for name, value in values.items():
            _set(new, f"{section}.{name}", value, "replace")
    return new
