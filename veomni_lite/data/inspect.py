"""`python -m veomni_lite.data.inspect CONFIG.yaml [--n 3] [--split train|eval] [--section.key VALUE ...]`

Builds the SFT data of a config exactly as `trainers/train_sft.py` does (tokenizer, template, labels, images, lengths)
without a process group or a model, and prints the first samples decoded: the tokens that train between `[[` and
`]]`, image placeholders collapsed to `<image x N>`, and per sample its tokens, trained tokens and images; then what
`data.overlength` did. Bad data (a template that raises on a row included) fails here with the same error the
trainer would give. `sample K` counts the samples kept; the row it came from is named `row N (0-based)` within its
file, as in every error.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from veomni_lite.config import ConfigError, load_config
from veomni_lite.data.checks import DataError
from veomni_lite.loss_keys import IGNORE_INDEX


def render(tokenizer: Any, input_ids: list[int], labels: list[int], image_token_id: int | None) -> str:
    """The sample's text with trained spans in [[ ]] and each run of image placeholders as <image x N>."""
    out: list[str] = []
    index = 0
    while index < len(input_ids):
        token = input_ids[index]
        end = index + 1
        if token == image_token_id:
            while end < len(input_ids) and input_ids[end] == image_token_id:
                end += 1
            out.append(f"<image x {end - index}>")
        else:
            trains = labels[index] != IGNORE_INDEX
            while end < len(input_ids) and input_ids[end] != image_token_id and (labels[end] != IGNORE_INDEX) == trains:
                end += 1
            text = tokenizer.decode(input_ids[index:end])
            out.append(f"[[{text}]]" if trains else text)
        index = end
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m veomni_lite.data.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--n", type=int, default=3, help="samples to print")
    parser.add_argument("--split", choices=("train", "eval"), default="train")
    args, overrides = parser.parse_known_args(argv)
    from veomni_lite.trainer.sft import build_sft_data

    try:
        config = load_config(args.config, overrides, world_size=1)
        model_config, tokenizer, train, evaluation, images = build_sft_data(config)
    except (ConfigError, DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dataset = train if args.split == "train" else evaluation
    if dataset is None:
        print(
            "no eval data: data.eval_path is not set (a run that evaluates holds out data.eval_fraction)",
            file=sys.stderr,
        )
        return 2
    image_token_id = model_config.image_token_id if images is not None else None
    for index in range(min(args.n, len(dataset))):
        ids, labels = (column.tolist() for column in dataset.tokens(index))
        trained = sum(label != IGNORE_INDEX for label in labels)
        where, images = dataset.where(index), len(dataset.image_references(index)[0])
        print(f"--- sample {index} ({where}): {len(ids)} tokens, {trained} trained, {images} image(s)")
        print(render(tokenizer, ids, labels, image_token_id))
    print(f"--- {args.split}: {len(dataset)} samples from {dataset.stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
