"""A local transformers model directory: its config, tokenizer, image processor and weights, none of them running code.

Every loader passes `trust_remote_code=False` and `local_files_only=True`; a directory whose config maps to custom
code (`auto_map`) is refused with an error naming it, before anything is built. `load_model` returns the model behind
the trainer's contract, as its family (`veomni_lite.models.registry`) wraps it, with float32 parameters by default
whatever dtype the directory stores (bf16 releases included: a bf16 master weight rounds small updates away).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from veomni_lite.models.registry import family_of

LOCAL_ONLY = {"trust_remote_code": False, "local_files_only": True}  # every from_pretrained here
_PLAIN_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


class PretrainedDirError(ValueError):
    """A model directory that cannot be used as it is (the message names it)."""


def load_config(directory: str | Path) -> Any:
    from transformers import AutoConfig

    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise PretrainedDirError(f"model.pretrained_dir: {directory} has no config.json (a from_pretrained directory)")
    config_dict = json.loads((directory / "config.json").read_text())
    if config_dict.get("auto_map"):
        raise PretrainedDirError(
            f"model.pretrained_dir: {directory} needs custom code ({sorted(config_dict['auto_map'])} in config.json); "
            "veomni_lite loads models with trust_remote_code=False and never runs code from a model directory"
        )
    return AutoConfig.from_pretrained(str(directory), **LOCAL_ONLY)


def is_vision_language(config: Any) -> bool:
    return family_of(config).vision is not None


def save_config(config: Any, directory: str | Path, dtype: torch.dtype) -> None:
    """`directory/config.json` of `config`, saying `dtype` as the weights' dtype (what an export writes by default)."""
    trained = config.dtype
    config.dtype = dtype
    try:
        config.save_pretrained(str(directory))
    finally:
        config.dtype = trained


def hf_child(model: torch.nn.Module) -> tuple[str, Any]:
    """(attribute name, module) of the transformers model inside a trainer-contract wrapper."""
    from transformers import PreTrainedModel

    for name, child in model.named_children():
        if isinstance(child, PreTrainedModel):
            return name, child
    raise TypeError(f"{type(model).__name__} holds no transformers PreTrainedModel")


def text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def load_tokenizer(directory: str | Path) -> Any:
    """The directory's tokenizer: the plain fast tokenizer of its tokenizer.json where its tokenizer_config.json says
    so (AutoTokenizer would pick the model type's class, which may add tokens), else AutoTokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    settings = Path(directory) / "tokenizer_config.json"
    plain = settings.is_file() and json.loads(settings.read_text()).get("tokenizer_class") in _PLAIN_TOKENIZERS
    try:
        return (PreTrainedTokenizerFast if plain else AutoTokenizer).from_pretrained(str(directory), **LOCAL_ONLY)
    except (OSError, ValueError) as exc:
        raise PretrainedDirError(f"model.pretrained_dir: {directory} has no usable tokenizer: {exc}") from None


def check_vocabulary(tokenizer: Any, config: Any, directory: str | Path) -> None:
    """The tokenizer's ids fit the model's embedding rows."""
    rows = text_config(config).vocab_size
    if len(tokenizer) > rows:
        raise PretrainedDirError(
            f"model.pretrained_dir: {directory} has a tokenizer of {len(tokenizer)} tokens but the model embeds only "
            f"{rows} (vocab_size in config.json)"
        )


def load_image_processor(directory: str | Path) -> Any:
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(directory), **LOCAL_ONLY)
    except (OSError, ValueError) as exc:
        raise PretrainedDirError(f"model.pretrained_dir: {directory} has no usable image processor: {exc}") from None


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The model of `directory` behind the trainer's model contract, parameters in `dtype` (module docstring)."""
    return family_of(load_config(directory)).load(directory, dtype)
