"""A local transformers model directory: its config, tokenizer, image processor and weights, none of them running code.

Every loader passes `trust_remote_code=False` and `local_files_only=True`; a directory whose config maps to custom
code (`auto_map`) is refused with an error naming it, before anything is built. `load_model` returns the model behind
the trainer's contract, as its family (`veomni_lite.models.registry`) wraps it, with float32 parameters by default
whatever dtype the directory stores (bf16 releases included: a bf16 master weight rounds small updates away).
`read_model_directory` is what every trainer reads from `model.pretrained_dir` before its data (`ModelDirectory`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from veomni_lite.data.sft import ChatEncoder
from veomni_lite.data.sft_dataset import ImageProcessing
from veomni_lite.models.registry import Family, family_of

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


def image_token(tokenizer: Any, model_config: Any, directory: str | Path) -> str:
    """The image placeholder token of a vision-language directory: its config's `image_token_id`, as the tokenizer
    spells it (a PretrainedDirError where the tokenizer does not have it)."""
    token_id = getattr(model_config, "image_token_id", None)
    token = tokenizer.convert_ids_to_tokens(token_id) if isinstance(token_id, int) else None
    if not token or tokenizer.convert_tokens_to_ids(token) != token_id:
        raise PretrainedDirError(
            f"model.pretrained_dir: {directory}: config.json's image_token_id {token_id!r} is not a token of its "
            "tokenizer"
        )
    return token


@dataclass(frozen=True)
class ModelDirectory:
    """What a run reads from `model.pretrained_dir` before its data (`read_model_directory`)."""

    config: Any
    """The transformers config."""
    tokenizer: Any
    family: Family
    images: ImageProcessing | None
    """The directory's image processor with its family's image-token count; None for a text family."""
    encoder: ChatEncoder
    """Conversations -> tokens and labels, with the image placeholder of a vision-language family."""


def read_model_directory(
    directory: str | Path, chat_template: str = "", train_on_prompt: bool = False
) -> ModelDirectory:
    """The config, tokenizer (its ids checked against the embedding rows), family, image processing (a vision-language
    family) and chat encoder (`data.chat_template`, `data.train_on_prompt`) of `directory`; a PretrainedDirError
    naming it where one is missing or unusable."""
    config = load_config(directory)
    tokenizer = load_tokenizer(directory)
    check_vocabulary(tokenizer, config, directory)
    family = family_of(config)
    images, placeholder = None, ""
    if family.vision is not None:
        images = ImageProcessing(load_image_processor(directory), family.image_tokens())
        placeholder = image_token(tokenizer, config, directory)
    encoder = ChatEncoder(tokenizer, chat_template, train_on_prompt, placeholder, str(directory))
    return ModelDirectory(config, tokenizer, family, images, encoder)
