"""What a user brings to `trainers/train_sft.py`, written to disk from data that ships offline.

`python -m examples.sft_demo OUT_DIR` writes (idempotent; nothing is downloaded):
- `OUT_DIR/digits/{train,eval}.jsonl` + `OUT_DIR/digits/images/*.png`: scikit-learn's 1,797 handwritten digits as an
  OpenAI `messages` dataset, the image a typed part of the user turn, the answer "a handwritten seven"; the held-out
  20% are the images the built-in digits job holds out (the same seeded permutation);
- `OUT_DIR/help/train.jsonl`: Python's help pages (`pydoc_data.topics`) as a `sharegpt` dataset, one turn pair per
  paragraph of a topic (lengths from a few tokens to the 256 of `max_seq_len`);
- `OUT_DIR/models/qwen2_vl_digits` and `OUT_DIR/models/qwen2_help`: `from_pretrained` directories of a tiny,
  randomly initialized Qwen2-VL and Qwen2 with a byte-level BPE tokenizer trained on the data, its own ChatML chat
  template (Qwen2-VL's image markup for the VL one) and, for Qwen2-VL, a `Qwen2VLImageProcessor` sized for 8x8
  images (4 image tokens each).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

PROMPT = "What digit is this?"
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# Qwen2-VL's markup: an image part is <|vision_start|><|image_pad|><|vision_end|> (one placeholder, expanded later).
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    """`rows` as JSON Lines at `path`, written whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.replace(path)


def write_digits(out: Path, eval_fraction: float = 0.2) -> list[str]:
    """The digits as `messages` rows with PNG images; returns the texts (for the tokenizer)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = torch.randperm(len(digits.target), generator=torch.Generator().manual_seed(0)).tolist()
    held_out = set(order[: int(len(order) * eval_fraction)])
    (out / "images").mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    for index, (image, target) in enumerate(zip(digits.images, digits.target)):
        name = f"images/{index:05d}.png"
        Image.fromarray((image * (255 / 16)).round().astype("uint8"), mode="L").save(out / name)
        row = {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]},
                {"role": "assistant", "content": f"a handwritten {WORDS[target]}"},
            ],
            "images": [name],
        }
        splits["eval" if index in held_out else "train"].append(row)
    for split, rows in splits.items():
        write_jsonl(out / f"{split}.jsonl", rows)
    return [PROMPT, *(f"a handwritten {word}" for word in WORDS)]


def write_help(out: Path) -> list[str]:
    """The help pages as `sharegpt` rows, one per paragraph (a few words to a few thousand characters, so the lengths
    vary as in real SFT data); returns the texts."""
    from pydoc_data.topics import topics

    rows, texts = [], []
    for name in sorted(topics):
        paragraphs = [p.strip() for p in topics[name].split("\n\n") if p.strip()]
        for part, answer in enumerate(paragraphs):
            question = f"Show paragraph {part + 1} of the Python help topic {name!r}."
            rows.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
            texts += [question, answer]
    write_jsonl(out / "train.jsonl", rows)
    return texts


def write_tokenizer(directory: Path, texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on `texts`, with the chat tokens and template, saved for AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    from examples.pydoc_text import train_bpe

    core = train_bpe(texts, vocab_size, SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE
    )
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def write_vl_model(directory: Path, texts: list[str], family: str = "qwen2_vl", vllm: bool = False) -> None:
    """A tiny vision-language directory of `family` (qwen2_vl, qwen2_5_vl or qwen3_vl): weights, tokenizer with the
    chat template, and a `Qwen2VLImageProcessor` of 2x2 patches merged 2x2. `vllm`: what vLLM needs to serve it,
    head dim 32 (the smallest its CPU attention takes; else 16) and a `<|video_pad|>` token (its Qwen-VL processors
    look it up), added after the others so every other id stays."""
    import transformers

    tokenizer = write_tokenizer(directory, texts, vocab_size=300)
    if vllm:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|video_pad|>"]})
        tokenizer.save_pretrained(str(directory))
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL}
    head_dim = 32 if vllm else 16
    text = {
        "hidden_size": 4 * head_dim,
        "intermediate_size": 8 * head_dim,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [head_dim // 4, head_dim // 8, head_dim // 8],
        },
        "vocab_size": len(tokenizer),
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": False,
        "initializer_range": 0.05,
    }
    vision = {"num_heads": 2, "in_channels": 3, "patch_size": 2, "temporal_patch_size": 1, "spatial_merge_size": 2}
    vision["initializer_range"] = 0.05
    if family == "qwen2_vl":
        vision |= {"depth": 1, "embed_dim": 32, "mlp_ratio": 2, "hidden_size": text["hidden_size"]}
    else:
        vision |= {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": text["hidden_size"]}
        if family == "qwen2_5_vl":
            vision |= {"window_size": 8, "fullatt_block_indexes": [1]}
        else:
            vision |= {"num_position_embeddings": 16, "deepstack_visual_indexes": [0]}
            text["rope_parameters"]["mrope_interleaved"] = True
    classes = {
        "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
    }
    config_class, model_class = classes[family]
    config = config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(0)
    model_class(config).save_pretrained(str(directory), safe_serialization=True)
    # the PIL backend by name: what `Qwen2VLImageProcessor` falls back to without torchvision, minus the warning that
    # it fell back; it saves the same preprocessor_config.json (image_processor_type Qwen2VLImageProcessor)
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=2, temporal_patch_size=1, merge_size=2, min_pixels=64, max_pixels=4096
    )
    processor.save_pretrained(str(directory))


def write_text_model(directory: Path, texts: list[str]) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = write_tokenizer(directory, texts, vocab_size=2048)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory), safe_serialization=True)


def write_demo(out: str | Path) -> Path:
    """Everything in the module docstring under `out` (skipped where it exists)."""
    out = Path(out)
    done = out / ".complete-v2"  # v2: the help pages one paragraph per row
    if done.is_file():
        return out
    digit_texts = write_digits(out / "digits")
    help_texts = write_help(out / "help")
    write_vl_model(out / "models" / "qwen2_vl_digits", digit_texts)
    write_text_model(out / "models" / "qwen2_help", help_texts)
    done.write_text("written by python -m examples.sft_demo\n")
    return out


if __name__ == "__main__":
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" for each of two tiny directories
    path = write_demo(sys.argv[1] if len(sys.argv) > 1 else "outputs/sft_demo")
    print(f"[veomni_lite] SFT demo data and model directories in {path.resolve()}")
