"""Run configuration: one dataclass per concern (declared in `veomni_lite.config_sections`, imported from here), read
from YAML plus dotted CLI overrides, and checked.

Sections: `model` (which model), `data` (the training data), `train` (steps, batches, eval, outputs), `parallel`
(layout, precision, collective timeout), `optim` (AdamW and its schedule), `checkpoint`, `logging`, `loss` (modes),
`example` (what only the examples read, checked by them), and an entry point's own (`load_config(..., sections=)`:
`rl`, `pref`), typed fields of its `config_class`. Each field is documented where it is declared. The loader recurses:
a field whose type is a dataclass is a section too (`rl.critic`, `rl.vllm`), read from a mapping or key by key
(`--rl.critic.lr 1e-6`), every key checked against its dataclass at every depth. Old names keep working (see
`ALIASES`): `train.sp_size` means `parallel.sp_size`, `train.lr` `optim.lr`, `model.hidden_size`
`example.hidden_size`, `data.num_samples` `example.num_samples`, in YAML and on the command line.

`load_config(path, ["--train.max_steps", "7"])` -> Config. Every problem (unknown section or key, with the closest
known one at any depth; a value of the wrong type; a layout that does not fit the world size) raises ConfigError
naming the key, before any process group exists. `world_size` is read from the `WORLD_SIZE` environment variable
torchrun sets (1 without torchrun), or from the process group when one is already initialized.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import functools
import json
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

import yaml

from veomni_lite.config_sections import (  # noqa: F401 - the sections' public home stays this module
    _SECTIONS,
    ALIASES,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ExampleConfig,
    LoggingConfig,
    LossConfig,
    LossModeName,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    config_class,
)
from veomni_lite.registries import closest  # noqa: F401 - config checks and callers import it from here


def unknown_key(at: str, key: str, known: Iterable[str], takes: str) -> ConfigError:
    """The error for an unknown `key` of the entry at `at` (a mapping in a list: a reward, a tool, an environment):
    "`at`.`key`: unknown key (did you mean `x`?); `takes`", x the closest known key (`closest`), the hint left out
    when none is close."""
    guess = closest(key, known)
    hint = f" (did you mean `{guess}`?)" if guess else ""
    return ConfigError(f"{at}.{key}: unknown key{hint}; {takes}")


def config_entry(at: str, spec: Any, main: str, known: Sequence[str], what: str) -> Mapping[str, Any]:
    """A list entry of your own code (a tool, an environment) given as 'path/file.py:name' or a mapping of `known`
    keys, as a mapping whose `main` key (known[0]) is a non-empty string; else a ConfigError naming `at` (an unknown
    key with did-you-mean, "`what` takes ...")."""
    placeholder = "Class" if main == "class" else "function"
    if isinstance(spec, str):
        spec = {main: spec}
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{at}: expected 'path/file.py:{placeholder}' or {{{', '.join(known)}}}, got {spec!r}")
    for name in spec:
        if name not in known:
            raise unknown_key(at, str(name), known, f"{what} takes {', '.join(known)}")
    target = spec.get(main)
    if not isinstance(target, str) or not target:
        raise ConfigError(f"{at}.{main}: required, 'path/file.py:{placeholder}' (got {target!r})")
    return spec


def did_you_mean(dotted: str, sections: Mapping[str, type] | None = None) -> str:
    """The hint for a mistyped `section` or `section.name`: " (did you mean `x`?)", else "". x is the key of that name
    in another section, else the closest name (difflib's ratio at least 0.6) in the closest section (old flat `train.*`
    names included), else a name very close to it (0.8) in any section."""
    sections = _SECTIONS if sections is None else sections
    section, _, name = dotted.partition(".")
    keys = [f"{s}.{f.name}" for s, cls in sections.items() for f in fields(cls)] + list(ALIASES)
    names = [key.partition(".")[2] for key in keys]
    guess = closest(section, sections)
    if not name:
        return f" (did you mean `{guess}`?)" if guess else ""
    if name in names:
        return f" (did you mean `{keys[names.index(name)]}`?)"
    if guess:
        in_section = [key.partition(".")[2] for key in keys if key.startswith(f"{guess}.")]
        if close := closest(name, in_section):
            return f" (did you mean `{guess}.{close}`?)"
    if close := closest(name, names, cutoff=0.8):
        return f" (did you mean `{keys[names.index(close)]}`?)"
    return ""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """{field: its type} of a dataclass (annotations resolved)."""
    return typing.get_type_hints(cls)


def _field_type(section_cls: type, name: str) -> Any:
    return _hints(section_cls)[name]


def _is_union(expected: Any) -> bool:
    return typing.get_origin(expected) in (typing.Union, types.UnionType)


def _section_type(expected: Any) -> type | None:
    """The dataclass a field holds (a nested section; `X | None` unwrapped), else None."""
    arms = [arm for arm in typing.get_args(expected) if arm is not type(None)] if _is_union(expected) else [expected]
    return arms[0] if len(arms) == 1 and dataclasses.is_dataclass(arms[0]) else None


def _parse(key: str, value: str) -> Any:
    """A string from the command line (or a YAML string value) parsed as YAML; a ConfigError naming `key`."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse {value!r}: {exc}") from None


def _set_nested(target: dict[str, Any], dotted: str, path: list[str], value: Any) -> None:
    """`--model.hf.text_config.hidden_size 128`: set one field inside a dict-valued config field (YAML-parsed)."""
    if isinstance(value, str):
        value = _parse(dotted, value)
    for part in path[:-1]:
        inner = target.setdefault(part, {})
        if not isinstance(inner, dict):
            raise ConfigError(f"{dotted}: {part!r} holds {inner!r}, not a mapping")
        target = inner
    target[path[-1]] = value


def _coerce(key: str, value: Any, expected: Any) -> Any:
    """Check `value` against the field type (bool, int, float, str or a Literal of strings); strings from the CLI are
    parsed as YAML. `X | Y`: the first arm that takes it; None (YAML null) where None is an arm."""
    if _is_union(expected):
        arms = typing.get_args(expected)
        is_null = value is None or (isinstance(value, str) and value.strip() in ("null", "~", "None"))
        if is_null and type(None) in arms:
            return None
        problems = []
        for arm in (arm for arm in arms if arm is not type(None)):
            try:
                return _coerce(key, value, arm)
            except ConfigError as exc:
                problems.append(exc)
        if len(problems) == 1 or not all(isinstance(arm, type) for arm in arms):
            raise problems[0]
        names = " or ".join("None" if arm is type(None) else arm.__name__ for arm in arms)
        raise ConfigError(f"{key}: expected {names}, got {value!r} ({type(value).__name__})")
    if typing.get_origin(expected) is dict:
        if isinstance(value, str):  # `--model.hf '{model_type: qwen2, hidden_size: 64}'`
            value = _parse(key, value)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r} ({type(value).__name__})")
        return value
    if typing.get_origin(expected) is list and typing.get_args(expected)[0] is not str:  # betas; data.sources
        item_type = typing.get_args(expected)[0]
        if isinstance(value, str):  # `--optim.betas "[0.9, 0.95]"`
            value = _parse(key, value)
        if item_type is float:
            if not isinstance(value, list):
                raise ConfigError(f"{key}: expected a list of numbers, got {value!r} ({type(value).__name__})")
            return [_coerce(key, item, float) for item in value]
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise ConfigError(f"{key}: expected a list of mappings, got {value!r}")
        return value
    if typing.get_origin(expected) is list:
        if isinstance(value, str):
            with contextlib.suppress(yaml.YAMLError):
                parsed = yaml.safe_load(value)
                value = parsed if isinstance(parsed, list) else value
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{key}: expected a string or a list of strings, got {value!r}")
        return value
    if typing.get_origin(expected) is Literal:
        choices = typing.get_args(expected)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        return value
    if isinstance(value, str) and expected in (int, float):
        with contextlib.suppress(ValueError):
            return expected(value)  # "1e-3" is a float here, although YAML 1.1 reads it as a string
    if isinstance(value, str) and expected is not str:
        value = _parse(key, value)
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


def _section_classes(config: Config) -> dict[str, type]:
    """Every section `config` takes: the shared ones and its entry point's own (`config_class`)."""
    return _hints(type(config))


def _assign(target: Any, name: str, value: Any) -> None:
    object.__setattr__(target, name, value)  # a frozen section (rl.critic) is filled here, before anyone reads it


def _set(config: Config, dotted: str, value: Any, source: str) -> str:
    """Set one key, at any depth; returns the field it set, e.g. `section.name` (old names resolved)."""
    given = dotted
    head = ".".join(dotted.split(".")[:2])
    dotted = ALIASES.get(head, head) + dotted[len(head) :]
    section, _, name = dotted.partition(".")
    classes = _section_classes(config)
    if section not in classes or not name:
        hint = did_you_mean(dotted, classes)
        raise ConfigError(f"{source}: unknown config key {dotted!r}{hint}; sections are {sorted(classes)}")
    return _set_in(getattr(config, section), section, name.split("."), value, source, given, classes)


def _set_in(
    target: Any, at: str, path: list[str], value: Any, source: str, given: str, classes: Mapping[str, type]
) -> str:
    """Set `path` inside `target`, the section named `at` (a dataclass); `given` is the key as the user wrote it."""
    known = [f.name for f in fields(target)]
    name, *nested = path
    key = f"{at}.{name}"
    if name not in known:
        if "." in at or not classes:  # a nested section: the closest of its own fields
            close = closest(name, known)
            hint = f" (did you mean `{at}.{close}`?)" if close else ""
        else:
            hint = did_you_mean(key, classes)
        raise ConfigError(f"{source}: unknown config key {given!r}{hint}; {at} has {sorted(known)}")
    expected = _field_type(type(target), name)
    inner = _section_type(expected)
    if inner is not None:
        if nested:
            if getattr(target, name) is None:
                _assign(target, name, inner())
            return _set_in(getattr(target, name), key, nested, value, source, given, classes)
        if isinstance(value, str):
            value = _parse(key, value)
        if value is None or (value == {} and inner is not expected):  # an optional section left unset
            if inner is expected:
                raise ConfigError(f"{source}: {key}: expected a mapping, got None")
            _assign(target, name, None)
            return key
        if not isinstance(value, Mapping):
            listed = ", ".join(f.name for f in fields(inner))
            raise ConfigError(f"{source}: {key}: expected a mapping ({listed}), got {value!r}")
        _assign(target, name, inner())  # a mapping given whole replaces the section
        for child, child_value in value.items():
            _set_in(getattr(target, name), key, [str(child)], child_value, source, f"{given}.{child}", classes)
        return key
    if nested:
        if typing.get_origin(expected) is not dict:
            shown = given.rsplit(".", len(nested))[0]
            raise ConfigError(f"{source}: unknown config key {given!r}; {shown} has no fields")
        try:
            _set_nested(getattr(target, name), f"{key}.{'.'.join(nested)}", nested, value)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        return key
    try:
        coerced = _coerce(key, value, expected)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    _assign(target, name, coerced)
    return key


def build_section(cls: type, values: Mapping[str, Any] | None, at: str) -> Any:
    """A section of `cls` (a dataclass) from a mapping, each key checked as the loader checks it (ConfigError naming
    `at.key`, with the closest known key); e.g. `build_section(VLLMSettings, {"url": ...}, "rl.vllm")`."""
    if values is not None and not isinstance(values, Mapping):
        raise ConfigError(f"{at}: expected a mapping ({', '.join(f.name for f in fields(cls))}), got {values!r}")
    section = cls()
    for name, value in (values or {}).items():
        _set_in(section, at, [str(name)], value, at, f"{at}.{name}", {})
    return section


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


def _attention_heads(model: ModelConfig) -> dict[str, int]:
    """{config key: number} of the attention (and key/value) heads of a transformers model that Ulysses splits (the
    tiny examples check their own: `examples.settings.check_example`)."""
    if model.arch == "tiny":
        return {}
    settings, prefix = model.hf, "model.hf"
    if model.pretrained_dir:
        config_file = Path(model.pretrained_dir) / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model.pretrained_dir: {config_file} does not exist")
        settings, prefix = json.loads(config_file.read_text()), str(config_file)
    if "text_config" in settings:
        settings, prefix = settings["text_config"], f"{prefix}.text_config"
    heads = {f"{prefix}.{n}": settings[n] for n in ("num_attention_heads", "num_key_value_heads") if n in settings}
    return {key: value for key, value in heads.items() if isinstance(value, int)}


NAMED_ARCHES = ("tiny", "auto")  # the archs that are not a model_type of a family in the registry


def _check_arch(model: ModelConfig) -> None:
    from veomni_lite.models.registry import FAMILIES, is_model_type

    if model.arch == "auto" and not model.pretrained_dir:
        raise ConfigError("model.arch: auto takes the model of model.pretrained_dir, which is not set")
    if model.arch not in NAMED_ARCHES and not is_model_type(model.arch):
        listed = [t for family in FAMILIES for t in family.model_types]
        raise ConfigError(
            f"model.arch: {model.arch!r} is neither tiny, auto, one of {listed} nor a transformers causal-LM "
            "model_type (qwen2, llama, ...)"
        )


def _check_lora(model: ModelConfig) -> None:
    """`model.lora`'s values, and its target modules against the directory's model (built on the meta device)."""
    if not model.lora:
        return
    from veomni_lite.models.lora import LoraError, LoraSettings, check_directory
    from veomni_lite.models.pretrained import PretrainedDirError

    try:
        settings = LoraSettings.parse(model.lora)
        if settings is None:
            return
        if model.arch == "tiny":
            raise LoraError("model.lora: LoRA adapts a transformers model; model.arch tiny is an example model")
        if not model.pretrained_dir:
            raise LoraError(
                "model.lora: LoRA adapts a pretrained model, and its base is rebuilt from model.pretrained_dir "
                "on resume and export; set model.pretrained_dir"
            )
        check_directory(model.pretrained_dir, settings)
    except (LoraError, PretrainedDirError) as exc:
        raise ConfigError(str(exc)) from None


def _check_run_length(config: Config) -> None:
    train, optim = config.train, config.optim
    if train.max_steps and train.epochs:
        raise ConfigError(
            f"train.max_steps ({train.max_steps}) and train.epochs ({train.epochs}) are both set: they are "
            "alternatives, set one (the other to 0)"
        )
    if not (train.max_steps or train.epochs):
        raise ConfigError("train.max_steps: must be >= 1, or train.epochs >= 1 (both are 0)")
    if optim.warmup_steps and optim.warmup_ratio:
        raise ConfigError(
            f"optim.warmup_steps ({optim.warmup_steps}) and optim.warmup_ratio ({optim.warmup_ratio}) are both set: "
            "they are alternatives, set one (the other to 0)"
        )


def _check_optim(optim: OptimConfig) -> None:
    if optim.lr <= 0:
        raise ConfigError(f"optim.lr: must be > 0, got {optim.lr}")
    if not 0 <= optim.warmup_ratio < 1:
        raise ConfigError(f"optim.warmup_ratio: must be in [0, 1), got {optim.warmup_ratio}")
    for key, value in (("optim.decay_ratio", optim.decay_ratio), ("optim.min_lr_ratio", optim.min_lr_ratio)):
        if not 0 <= value <= 1:
            raise ConfigError(f"{key}: must be in [0, 1], got {value}")
    if len(optim.betas) != 2 or not all(0 <= beta < 1 for beta in optim.betas):
        raise ConfigError(f"optim.betas: expected [beta1, beta2], each in [0, 1), got {optim.betas}")


SOURCE_KEYS = ("path", "format", "weight", "columns", "media_dir")


def _check_sources(data: DataConfig) -> None:
    """`data.sources` entries: known keys of the right types; not together with `data.train_path`."""
    if data.sources and data.train_path:
        raise ConfigError("data.sources and data.train_path are both set: give the training data one way")
    formats = typing.get_args(_field_type(DataConfig, "format"))
    for index, entry in enumerate(data.sources):
        where = f"data.sources[{index}]"
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            close = difflib.get_close_matches(unknown[0], SOURCE_KEYS, n=1)
            hint = f" (did you mean `{close[0]}`?)" if close else ""
            raise ConfigError(f"{where}: unknown key(s) {unknown}{hint}; a source has {list(SOURCE_KEYS)}")
        path = entry.get("path")
        if not path or not (
            isinstance(path, str) or (isinstance(path, list) and all(isinstance(p, str) for p in path))
        ):
            raise ConfigError(f"{where}.path: expected a path, glob or list of them, got {path!r}")
        if entry.get("format", data.format) not in formats:
            raise ConfigError(f"{where}.format: {entry['format']!r} is not one of {list(formats)}")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{where}.weight: expected a number > 0, got {weight!r}")
        if not isinstance(entry.get("columns", {}), dict) or not isinstance(entry.get("media_dir", ""), str):
            raise ConfigError(f"{where}: columns must be a mapping and media_dir a string")


def _check_streaming(config: Config) -> None:
    """`data.streaming` with what a stream cannot do refused, naming the key."""
    data, train = config.data, config.train
    if data.shuffle_window < 1:
        raise ConfigError(f"data.shuffle_window: must be >= 1 (1: file order), got {data.shuffle_window}")
    if not data.streaming:
        return
    why = "data.streaming does not know (it reads the files in order)"
    if data.sources:
        raise ConfigError(f"data.sources: weighted sources draw by each source's length, which {why}; use "
                          "data.train_path (its files are read in order) or turn data.streaming off")  # fmt: skip
    if train.epochs:
        raise ConfigError(f"train.epochs ({train.epochs}) needs the epoch's length, which {why}; set train.max_steps")
    if data.num_workers:
        raise ConfigError(
            f"data.num_workers ({data.num_workers}): data.streaming reads in the trainer's process; set 0"
        )
    if train.eval_interval and train.eval_batches and not data.eval_path:
        raise ConfigError(
            "data.eval_path: evaluation (train.eval_interval, train.eval_batches) under data.streaming needs it: a "
            "stream holds no rows out (data.eval_fraction); give data.eval_path or set train.eval_batches 0"
        )


def validate(config: Config, world_size: int | None = None) -> None:
    """Cross-field checks; raise ConfigError naming the key."""
    world_size = config.world_size if world_size is None else world_size
    train, parallel = config.train, config.parallel
    positive = {
        "parallel.sp_size": parallel.sp_size,
        "train.micro_batch_size": train.micro_batch_size,
        "train.global_batch_size": train.global_batch_size,
        "logging.log_interval": config.logging.log_interval,
        "checkpoint.keep_checkpoints": config.checkpoint.keep_checkpoints,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    non_negative = {
        "checkpoint.save_interval": config.checkpoint.save_interval,
        "train.eval_interval": train.eval_interval,
        "train.eval_batches": train.eval_batches,
        "optim.warmup_steps": config.optim.warmup_steps,
        "train.max_steps": train.max_steps,
        "train.epochs": train.epochs,
        "optim.weight_decay": config.optim.weight_decay,
        "optim.eps": config.optim.eps,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    _check_run_length(config)
    _check_optim(config.optim)
    for key, heads in _attention_heads(config.model).items():
        if heads % parallel.sp_size:
            raise ConfigError(
                f"parallel.sp_size ({parallel.sp_size}) does not divide {key} ({heads}): "
                "Ulysses attention splits heads across the sp group"
            )
    if world_size % parallel.sp_size:
        raise ConfigError(f"parallel.sp_size ({parallel.sp_size}) does not divide the world size ({world_size})")
    dp_size = world_size // parallel.sp_size
    if parallel.dp_replicate < 1 or dp_size % parallel.dp_replicate:
        raise ConfigError(
            f"parallel.dp_replicate ({parallel.dp_replicate}) must be >= 1 and divide the dp size ({dp_size} = world "
            f"{world_size} / sp {parallel.sp_size}), so that each replica holds whole sp groups"
        )
    if parallel.ep_size < 1 or world_size % (parallel.ep_size * parallel.dp_replicate):
        raise ConfigError(
            f"parallel.ep_size ({parallel.ep_size}) must be >= 1 and divide the world size ({world_size} = dp "
            f"{dp_size} x sp {parallel.sp_size}) / parallel.dp_replicate ({parallel.dp_replicate}): the experts are "
            "sharded over groups of ep_size ranks inside each HSDP shard block"
        )
    per_step = train.micro_batch_size * dp_size
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size ({train.global_batch_size}) is not divisible by train.micro_batch_size "
            f"({train.micro_batch_size}) x dp size ({dp_size} = world {world_size} / sp {parallel.sp_size})"
        )
    if config.data.prefetch_steps < -1:
        raise ConfigError(f"data.prefetch_steps: must be >= -1, got {config.data.prefetch_steps}")
    if config.data.num_workers < 0:
        raise ConfigError(f"data.num_workers: must be >= 0, got {config.data.num_workers}")
    _check_sources(config.data)
    _check_streaming(config)
    _check_arch(config.model)
    _check_lora(config.model)
    try:
        config.loss.resolved()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# Keys that are alternatives to each other (how long the run is, how long the warmup is): of each pair, the one a YAML
# or the command line sets replaces the other's default with 0; setting both nonzero is an error.
ALTERNATIVES: tuple[tuple[str, str], ...] = (
    ("train.max_steps", "train.epochs"),
    ("optim.warmup_steps", "optim.warmup_ratio"),
)


def _get(config: Config, dotted: str) -> Any:
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def _resolve_alternatives(config: Config, explicit: dict[str, str]) -> None:
    """`explicit`: {key: where it was set} for the keys the YAML and the command line set."""
    for pair in ALTERNATIVES:
        given = [key for key in pair if key in explicit]
        if len(given) == 1:
            (other,) = set(pair) - set(given)
            section, name = other.split(".")
            setattr(getattr(config, section), name, type(_get(config, other))(0))
        elif len(given) == 2 and all(_get(config, key) > 0 for key in pair):
            first, second = (f"{key} ({_get(config, key)}, {explicit[key]})" for key in pair)
            raise ConfigError(f"{first} and {second} are both set: they are alternatives, set one (the other to 0)")


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    world_size: int | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
    sections: Mapping[str, type] | None = None,
) -> Config:
    """Defaults <- YAML file <- dotted overrides, then `validate`. `defaults`, e.g. `{"optim": {"lr": 1e-5}}`, replace
    the dataclasses' own (an entry point's defaults, such as `veomni_lite.trainer.sft.SFT_DEFAULTS`); of each pair of
    `ALTERNATIVES` the key the YAML or the command line sets replaces the other's default. `sections`: the entry
    point's own sections (`{"rl": RLConfig}`), typed fields of the config (`config_class`), each checked by its
    `validate(config)` method where it has one."""
    config = config_class(tuple((sections or {}).items()))()
    for section, values in (defaults or {}).items():
        for name, value in values.items():
            _set(config, f"{section}.{name}", value, "defaults")
    explicit: dict[str, str] = {}
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
            classes = _section_classes(config)
            if section not in classes:
                hint = did_you_mean(section, classes)
                raise ConfigError(f"{path}: unknown config section {section!r}{hint}; sections are {sorted(classes)}")
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping, got {type(values).__name__}")
            for name, value in values.items():
                explicit[_set(config, f"{section}.{name}", value, str(path))] = str(path)
    for key, value in parse_overrides(overrides or []):
        explicit[_set(config, key, value, "command line")] = "command line"
    _resolve_alternatives(config, explicit)
    validate(config, world_size)
    for section in config.sections.values():
        check = getattr(section, "validate", None)
        if callable(check):
            check(config)
    return config


def replace(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of `config` with some section fields replaced, e.g. `replace(cfg, train={"max_steps": 3})`."""
    new = copy.deepcopy(config)
    for section, values in sections.items():
        for name, value in values.items():
            _set(new, f"{section}.{name}", value, "replace")
    return new
