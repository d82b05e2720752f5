"""`make train-lora`'s files and its "before": LoRA teaches the digits SFT model a caption style it has not learned.

`python -m examples.lora_demo DEMO_DIR` writes `DEMO_DIR/digits/numeral_{train,eval}.jsonl` (idempotent): the rows of
`digits/{train,eval}.jsonl` (`examples/sft_demo.py`: same images, same question) answered with the numeral, "7",
where `make train-sft` taught "a handwritten seven".

`python -m examples.lora_demo --before CONFIG [--section.key VALUE ...]` measures on one process what the LoRA run of
that config starts from: `eval/answer_accuracy` and `eval/loss` of `model.pretrained_dir` on its eval rows, by the
trainer's own evaluation (`SFTTrainer`; LoRA's `lora_B` starts at zero, so the adapted model is the base until the
first step), written to `<train.output_dir>/before.json`.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from examples.sft_demo import WORDS, write_jsonl


def write_numerals(demo: str | Path) -> Path:
    """The digits' rows with the numeral as the answer, beside the digits' own files (their images resolve alike)."""
    digits = Path(demo) / "digits"
    for split in ("train", "eval"):
        out = digits / f"numeral_{split}.jsonl"
        if out.is_file():
            continue
        rows = [json.loads(line) for line in (digits / f"{split}.jsonl").read_text().splitlines()]
        for row in rows:
            answer = row["messages"][-1]
            answer["content"] = str(WORDS.index(answer["content"].removeprefix("a handwritten ")))
        write_jsonl(out, rows)
    return digits


def measure_before(argv: list[str]) -> dict[str, float]:
    """The eval values (`eval/loss`, `eval/answer_accuracy`, ...) of `model.pretrained_dir` under the config `argv`
    gives (CONFIG, then overrides), on one process, written to `<train.output_dir>/before.json`. Its own outputs go
    under `<train.output_dir>/before/`; the preprocessed rows go where the run will look for them (`data.cache_dir`,
    default `<train.output_dir>/data_cache`), so the run reads them."""
    from veomni_lite.config import load_config
    from veomni_lite.trainer.sft import SFT_DEFAULTS, SFTTrainer

    config = load_config(argv[0], argv[1:], world_size=1, defaults=SFT_DEFAULTS)
    out = Path(config.train.output_dir)
    where = [
        "--train.output_dir",
        str(out / "before"),
        "--data.cache_dir",
        config.data.cache_dir or str(out / "data_cache"),
    ]
    trainer = SFTTrainer(load_config(argv[0], [*argv[1:], *where], world_size=1, defaults=SFT_DEFAULTS))
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the console sink's eval line would say "step 1"
            values = {key: float(value) for key, value in trainer.evaluate().items()}
    finally:
        trainer.close()
    (out / "before.json").write_text(json.dumps(values, indent=1) + "\n")
    return values


if __name__ == "__main__":
    if sys.argv[1:2] == ["--before"]:
        print(f"[veomni_lite] before LoRA: {measure_before(sys.argv[2:])}")
    else:
        path = write_numerals(sys.argv[1] if len(sys.argv) > 1 else "outputs/sft_demo")
        print(f"[veomni_lite] LoRA demo rows in {path.resolve()}/numeral_{{train,eval}}.jsonl")
