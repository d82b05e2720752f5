"""`python -m veomni_lite.export OUTPUT_DIR EXPORT_DIR`: a training run's latest checkpoint as a directory that
transformers' `from_pretrained` loads.

EXPORT_DIR gets `config.json` and `model.safetensors` (which the model family's transformers class loads, see
`veomni_lite.models.registry`: `AutoModelForCausalLM` for a causal LM, `Qwen2_5_VLForConditionalGeneration` for
Qwen2.5-VL, ...), in the source directory's dtype unless `--dtype` says otherwise (training keeps float32 masters),
the run's tokenizer, and, for heads transformers has no class for, their own safetensors file
(`image_decoder_head.safetensors`: Linear-GELU-Linear on the last hidden states). The tokenizer of a fine-tuned model
directory is its files copied byte for byte (`TOKENIZER_FILES`: the tokenizer, its chat template, generation config
and image processor files, which the SFT trainer copied from `model.pretrained_dir` into OUTPUT_DIR/model_config),
never re-saved through `AutoTokenizer`, whose class for the model type may tokenize differently; a run's
`data.chat_template` is in them as `chat_template.jinja`. A run that trained its own tokenizer
(OUTPUT_DIR/tokenizer.json) gets it as a `PreTrainedTokenizerFast`. Only safetensors, JSON and the tokenizer's own
files are written, never a pickle. The model is rebuilt from OUTPUT_DIR/model_config (written by the trainer) and
its weights are read from the newest complete checkpoint with the same safe readers as a resume, in one process.

A LoRA run (`model.lora`; OUTPUT_DIR/model_config/adapter_config.json) exports a PEFT adapter directory instead:
`adapter_config.json` (its `base_model_name_or_path` the run's `model.pretrained_dir`) and `adapter_model.safetensors`
(PEFT's names, float32 unless `--dtype` says otherwise), which `peft.PeftModel.from_pretrained(base model, EXPORT_DIR)`
loads; only the adapters are read and allocated. `--merge` writes a full model directory instead, as for a run
without LoRA: the base directory's weights with the adapters merged in (W + alpha / rank B A), in its dtype unless
`--dtype` says otherwise. A LoRA reward model (`pref.loss: bradley_terry`) trains its new score head whole: the
adapter directory holds it too (`task_type` SEQ_CLS, `modules_to_save` [score]: `PeftModel.from_pretrained` on
`AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)`), and `--merge` writes a directory that
`AutoModelForSequenceClassification` loads with the trained rewards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from veomni_lite.models.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_state,
    apply_peft_config,
    lora_modules,
    merge_lora,
    read_adapter_config,
    whole_modules,
)
from veomni_lite.models.pretrained import hf_child, load_config
from veomni_lite.models.registry import dtype_of, family_of
from veomni_lite.trainer.base import MODEL_CONFIG_DIR
from veomni_lite.trainer.checkpoint import CheckpointManager

TOKENIZER_FILE = "tokenizer.json"
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers reads it before tokenizer_config.json's chat_template
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"  # a processor's, read before chat_template.jinja
# What a model directory's tokenizer, chat template, generation settings and image processor are made of.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    CHAT_TEMPLATE_FILE,
    LEGACY_CHAT_TEMPLATE_FILE,
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
CHAT_TEMPLATES_DIR = "additional_chat_templates"
_SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}


def build_model(model_config_dir: str | Path, dtype: str = "auto") -> nn.Module:
    """The training wrapper of the architecture saved in `model_config_dir` (randomly initialized), its parameters in
    `dtype` (`EXPORT_DTYPES`; auto: the dtype the config says, the source directory's)."""
    config = load_config(model_config_dir)
    return family_of(config).build(config, dtype_of(config) if dtype == "auto" else EXPORT_DTYPES[dtype])


def save_tokenizer(tokenizer_file: Path, export_dir: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab()
    specials = {name: token for name, token in _SPECIAL_TOKENS.items() if token in vocab}
    PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **specials).save_pretrained(str(export_dir))


def _export_adapters(output_dir: Path, export_dir: Path, adapter: dict, dtype: str, merge: bool) -> int:
    """A LoRA run's adapters as a PEFT adapter directory, or (`merge`) merged into its base's weights as a model
    directory; returns the checkpoint step."""
    import json

    from safetensors.torch import save_file

    checkpoints = CheckpointManager(output_dir / "checkpoints", trainable_only=True)
    base = Path(adapter["base_model_name_or_path"])
    config = load_config(output_dir / MODEL_CONFIG_DIR)
    if merge:
        if not (base / "config.json").is_file():
            raise FileNotFoundError(f"--merge: the run's base model directory {base} (model.pretrained_dir) is gone")
        # the run's family (a reward model's new score head is in the checkpoint), float32 whatever the files store:
        # the merge is computed in float32
        model = family_of(config).load(base)
        apply_peft_config(model, adapter)
        step = checkpoints.load_model_weights(model)
        merge_lora(model)
        model.to(model.export_dtype if dtype == "auto" else EXPORT_DTYPES[dtype])
        export_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(export_dir)
        return step
    with torch.device("meta"):  # only the adapters (and the modules that train whole) are allocated and read
        model = family_of(config).build(config)
    apply_peft_config(model, adapter)
    for _, module in lora_modules(model):
        module.lora_A.to_empty(device="cpu")
        module.lora_B.to_empty(device="cpu")
    for path in whole_modules(model):
        hf_child(model)[1].get_submodule(path).to_empty(device="cpu")
    step = checkpoints.load_model_weights(model)
    export_dir.mkdir(parents=True, exist_ok=True)
    weights = adapter_state(model, None if dtype == "auto" else EXPORT_DTYPES[dtype])
    save_file(weights, str(export_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (export_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter, indent=2) + "\n")
    return step


def copy_tokenizer_files(
    source: str | Path, target: str | Path, chat_template: str = "", prune: bool = False
) -> list[str]:
    """Copy the `TOKENIZER_FILES` (and `additional_chat_templates/`) that `source` has into `target`, byte for byte;
    returns the names written. A `chat_template` (a run's `data.chat_template`, as Jinja text) is written as
    chat_template.jinja, which the tokenizer and the processor then read, and a legacy chat_template.json (which a
    processor would read first) is left out. `prune` removes those files `target` has but `source` lacks (a stale
    chat template of an earlier run in the same directory)."""
    import shutil

    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    skip = {CHAT_TEMPLATE_FILE, LEGACY_CHAT_TEMPLATE_FILE} if chat_template else set()
    written = []
    for name in (*TOKENIZER_FILES, CHAT_TEMPLATES_DIR):
        origin, copy = source / name, target / name
        if name in skip or not origin.exists():
            if prune and copy.is_dir():
                shutil.rmtree(copy)
            elif prune:
                copy.unlink(missing_ok=True)
            continue
        if origin.is_dir():
            shutil.copytree(origin, copy, dirs_exist_ok=True)
        else:
            shutil.copyfile(origin, copy)
        written.append(name)
    if chat_template:
        (target / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
        written.append(CHAT_TEMPLATE_FILE)
    return sorted(written)


def export(
    output_dir: str | Path, export_dir: str | Path, dtype: str = "auto", merge: bool = False
) -> tuple[int, list[str]]:
    """Write EXPORT_DIR from OUTPUT_DIR (see the module docstring) with weights in `dtype` (auto: the source
    directory's, float32 for a model built from a config; a LoRA run's adapters: float32); `merge`: a LoRA run's
    adapters merged into a model directory. Returns (checkpoint step, files written)."""
    output_dir, export_dir = Path(output_dir), Path(export_dir)
    model_config_dir = output_dir / MODEL_CONFIG_DIR
    if not (model_config_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_config_dir / 'config.json'} not found: export needs a run of a transformers model "
            "(model.arch qwen2 or qwen2_vl); the tiny example models have no transformers format"
        )
    adapter = read_adapter_config(model_config_dir)
    if adapter is not None:
        step = _export_adapters(output_dir, export_dir, adapter, dtype, merge)
    elif merge:
        raise ValueError(f"--merge: {output_dir} is not a LoRA run (no {MODEL_CONFIG_DIR}/{ADAPTER_CONFIG})")
    else:
        model = build_model(model_config_dir, dtype)
        step = CheckpointManager(output_dir / "checkpoints").load_model_weights(model)
        export_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(export_dir)
    copied = copy_tokenizer_files(model_config_dir, export_dir)  # a fine-tuned directory's own, byte for byte
    if not {"tokenizer.json", "tokenizer_config.json"} & set(copied) and (output_dir / TOKENIZER_FILE).is_file():
        save_tokenizer(output_dir / TOKENIZER_FILE, export_dir)
    return step, sorted(p.name for p in export_dir.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m veomni_lite.export", description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="the run's train.output_dir")
    parser.add_argument("export_dir", type=Path, help="where the from_pretrained directory goes")
    parser.add_argument(
        "--dtype",
        choices=["auto", *EXPORT_DTYPES],
        default="auto",
        help="the weights' dtype (auto: the source directory's, e.g. bfloat16 for a bf16 release; float32 otherwise; "
        "a LoRA adapter directory: float32)",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write a full model directory with the adapters merged (default: a PEFT adapter directory)",
    )
    args = parser.parse_args(argv)
    try:
        step, files = export(args.output_dir, args.export_dir, args.dtype, args.merge)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.output_dir} to {args.export_dir}: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
