"""`make train-envs`, step 1: a reasoning-gym task's warm start, written from a seed (nothing is downloaded).

`python -m examples.reasoning_gym_demo OUT_DIR` writes (skipped when `OUT_DIR/.complete-v1` records the same arguments):
- `OUT_DIR/sft_train.jsonl`: `sft_rows` questions of reasoning-gym's `basic_arithmetic` (`TASK`: two one-digit terms,
  + and -; "Calculate 4 - 9.") generated with seed `SFT_SEED`, each answered ("-5"): the SFT warm start;
- `OUT_DIR/models/qwen2_rg`: the tiny Qwen2 of `examples.rl_math.write_model` (random, seed 0) with a byte-level BPE
  tokenizer trained on those texts and a ChatML template.
RL then draws its prompts from the task itself (configs/rg_arith.yaml: `data.train_path: reasoning_gym:...` with seed
2, `data.eval_path` with seed 3: held-out questions, scored by the task's own `score_answer`). There are 200 such
facts; a few hundred SFT rows teach the format and part of them, so RL has the rest to learn.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TASK = "basic_arithmetic"
OPTIONS = {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ("+", "-"),
    "allow_parentheses": False, "allow_negation": False,
}  # fmt: skip
"""The task's config (configs/rg_arith.yaml's query strings say the same)."""
SFT_SEED = 1
MODEL = "models/qwen2_rg"


def write_demo(out: str | Path, sft_rows: int = 200) -> Path:
    """Everything in the module docstring under `out`."""
    import reasoning_gym

    from examples.rl_math import _write_jsonl, write_model

    out = Path(out)
    done = out / ".complete-v1"
    arguments = {"sft_rows": sft_rows, "task": TASK, "options": list(map(str, OPTIONS.items()))}
    if done.is_file() and json.loads(done.read_text()) == arguments:
        return out
    done.unlink(missing_ok=True)
    entries = list(reasoning_gym.create_dataset(TASK, size=sft_rows, seed=SFT_SEED, **OPTIONS))
    rows = [
        {"messages": [{"role": "user", "content": e["question"]}, {"role": "assistant", "content": e["answer"]}]}
        for e in entries
    ]
    _write_jsonl(out / "sft_train.jsonl", rows)
    write_model(out / MODEL, ["user", "assistant"] + [t for e in entries for t in (e["question"], e["answer"])])
    done.write_text(json.dumps(arguments) + "\n")
    return out


if __name__ == "__main__":
    path = write_demo(sys.argv[1] if len(sys.argv) > 1 else "outputs/reasoning_gym")
    print(f"[veomni_lite] reasoning-gym demo warm-start data and model directory in {path.resolve()}")
