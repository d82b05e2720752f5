"""The on-policy distillation demo's teacher and reward (`make train-distill`, docs/rl.md), beside `python -m
examples.rl_math OUT_DIR`'s problems and tiny Qwen2.

`python -m examples.distill_math OUT_DIR` writes (idempotent: skipped when `OUT_DIR/.teacher-v1` records the same
arguments):
- `OUT_DIR/teacher_train.jsonl`: `rows` worked problems of the RL split ("13 + 6 = 19"; the held-out problems are
  never among them), the teacher's SFT data (configs/distill_math_teacher_sft.yaml);
- `OUT_DIR/models/qwen2_math_teacher`: a larger randomly initialized Qwen2 (hidden `hidden_size`, `layers` layers)
  with the student's tokenizer and chat template (copied from `OUT_DIR/models/qwen2_math`: the teacher scores the
  student's token ids, so `rl.teacher` requires the same tokenizer).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from examples.dpo_math import _rows
from examples.preference_pairs import write_jsonl
from examples.rl_math import MODEL

TEACHER = "models/qwen2_math_teacher"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_teacher(out: str | Path, rows: int = 4000, hidden_size: int = 128, layers: int = 4) -> Path:
    """The teacher's SFT rows and model directory under `out` (module docstring); `out` must hold
    `examples.rl_math.write_demo(out)`'s files."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(out)
    done = out / ".teacher-v1"
    arguments = {"rows": rows, "hidden_size": hidden_size, "layers": layers}
    if done.is_file() and json.loads(done.read_text()) == arguments:
        return out
    done.unlink(missing_ok=True)
    train, _ = _rows(out)
    messages: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["solution"]}]}
        for r in train[:rows]
    ]
    write_jsonl(out / "teacher_train.jsonl", messages)
    student, teacher = out / MODEL, out / TEACHER
    teacher.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (student / name).is_file():
            shutil.copy(student / name, teacher / name)
    config = AutoConfig.from_pretrained(str(student), local_files_only=True)
    config.hidden_size, config.intermediate_size = hidden_size, hidden_size * 11 // 4
    config.num_hidden_layers, config.num_attention_heads = layers, hidden_size // config.head_dim
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(teacher), safe_serialization=True)
    done.write_text(json.dumps(arguments) + "\n")
    return out


def final_number(prompts: list[str], completions: list[str], answers: list[Any], **_: Any) -> list[float]:
    """The demo's reward (`rl.rewards` function `examples/distill_math.py:final_number`): 1.0 when a completion's last
    number is the answer ("13 + 6 = 19"), else 0.0. The worked solution's result is required: the built-in `math`
    reward also accepts the bare expression ("13 + 6" is equivalent to 19 for math-verify), which GRPO learns to
    write instead of the sum."""
    out = []
    for completion, answer in zip(completions, answers):
        numbers = re.findall(r"-?\d+", completion)
        out.append(float(bool(numbers) and numbers[-1] == str(answer).strip()))
    return out


if __name__ == "__main__":
    path = write_teacher(sys.argv[1] if len(sys.argv) > 1 else "outputs/rl_math")
    print(f"[veomni_lite] distillation teacher data and model directory in {Path(path).resolve() / TEACHER}")
