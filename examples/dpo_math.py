"""The preference demo's pairs and its greedy check, from the text RL demo's arithmetic problems (`examples.rl_math`).

`python -m examples.dpo_math pairs OUT_DIR` writes, beside `python -m examples.rl_math OUT_DIR`'s files (the same
seeded problems): `OUT_DIR/dpo_train.jsonl` (the RL split's problems) and `OUT_DIR/dpo_eval.jsonl` (the held-out
ones), TRL's explicit layout: the question as `prompt`, its worked solution ("13 + 6 = 19") as `chosen` and the same
solution off by one ("13 + 6 = 20" or "= 18", seeded) as `rejected`. The held-out problems are sentences the
training pairs never hold.

`python -m examples.dpo_math accuracy OUT_DIR JSON LABEL=MODEL_DIR...` writes to JSON (and prints) each model
directory's greedy accuracy on the held-out problems, {LABEL: accuracy} (transformers' `generate`, the chat
template's generation prompt, the last number of the answer against the reference).
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path
from typing import Any

import torch

from examples.preference_pairs import write_jsonl
from examples.rl_math import problems


def _rows(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The RL and held-out problems of `examples.rl_math.write_demo(out)` (its recorded arguments)."""
    args = json.loads((out / ".complete-v1").read_text())
    drawn = problems(args["sft_rows"] + args["rl_rows"] + args["eval_rows"], args["seed"], args["max_value"])
    sft, rl = args["sft_rows"], args["rl_rows"]
    return drawn[sft : sft + rl], drawn[sft + rl :]


def _pair(row: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    left, result = row["solution"].rsplit("= ", 1)
    wrong = int(result) + (1 if int(result) == 0 or rng.random() < 0.5 else -1)
    return {"prompt": row["question"], "chosen": row["solution"], "rejected": f"{left}= {wrong}"}


def write_pairs(out: str | Path, seed: int = 0) -> tuple[Path, Path]:
    out = Path(out)
    rl, held_out = _rows(out)
    rng = random.Random(seed)
    train = write_jsonl(out / "dpo_train.jsonl", [_pair(row, rng) for row in rl])
    evaluation = write_jsonl(out / "dpo_eval.jsonl", [_pair(row, rng) for row in held_out])
    return train, evaluation


@torch.no_grad()
def greedy_accuracy(out: str | Path, model_dir: str | Path, max_new_tokens: int = 12) -> float:
    """The share of held-out problems whose greedy answer ends in the reference number."""
    from transformers import AutoModelForCausalLM

    from veomni_lite.models.pretrained import load_tokenizer  # AutoTokenizer's qwen2 class splits the digits apart

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    _, held_out = _rows(Path(out))
    correct = 0
    for row in held_out:
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        generated = model.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        answer = tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True)
        numbers = re.findall(r"-?\d+", answer)
        correct += bool(numbers) and numbers[-1] == row["answer"]
    return correct / len(held_out)


if __name__ == "__main__":
    command, out = sys.argv[1], sys.argv[2]
    if command == "pairs":
        paths = write_pairs(out)
        print(f"[veomni_lite] preference pairs: {paths[0]}, {paths[1]}")
    elif command == "accuracy":  # accuracy OUT_DIR JSON LABEL=MODEL_DIR...
        labelled = dict(argument.split("=", 1) for argument in sys.argv[4:])
        accuracies = {label: greedy_accuracy(out, model) for label, model in labelled.items()}
        Path(sys.argv[3]).write_text(json.dumps(accuracies, indent=1) + "\n")
        print(f"[veomni_lite] held-out greedy accuracy: {accuracies} ({sys.argv[3]})")
    else:
        raise SystemExit(f"examples.dpo_math: unknown command {command!r} (pairs, accuracy)")
