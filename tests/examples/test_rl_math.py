"""The text RL demo's data (`examples/rl_math.py`): seeded and idempotent, each solution's number is the arithmetic
answer and the `math` reward agrees, the files hold distinct problems, and the model directory loads through the
library with its chat template, end of turn and single-token numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples import rl_math
from examples.rl_math import MODEL, facts, write_demo
from veomni_lite.rl.rewards import load_rewards, score

SIZES = {"sft_rows": 120, "rl_rows": 60, "eval_rows": 20}


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo(tmp_path_factory.mktemp("rl_math"), **SIZES)


def test_facts_cover_plus_and_minus_with_results_in_range():
    table = facts(20)
    assert len(table) == len(set(table)) == 190 + 210
    for op, a, b, result in table:
        assert 1 <= a <= 20 and 1 <= b <= 20 and 0 <= result <= 20
        assert result == (a + b if op == "+" else a - b)
    assert {result for *_, result in table} == set(range(21))


def test_files_rows_and_solutions(demo):
    train, rl_train, rl_eval = (read(demo / name) for name in ("train.jsonl", "rl_train.jsonl", "rl_eval.jsonl"))
    assert (len(train), len(rl_train), len(rl_eval)) == (120, 60, 20)
    for row in train:
        user, assistant = row["messages"]
        assert set(row) == {"messages"} and (user["role"], assistant["role"]) == ("user", "assistant")
        a, op, b, equals, result = assistant["content"].split()
        assert equals == "=" and int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert 0 <= int(result) <= 20 and f" {a} " in user["content"] and f" {b} " in user["content"]
    for row in rl_train + rl_eval:
        (user,) = row["messages"]
        assert set(row) == {"messages", "answer"} and user["role"] == "user" and 0 <= int(row["answer"]) <= 20
    assert {row["messages"][1]["content"].split()[1] for row in train} == {"+", "-"}
    questions = [row["messages"][0]["content"] for row in train + rl_train + rl_eval]
    assert len(set(questions)) == len(questions)  # every problem once across the three files


def test_math_reward_scores_every_solution_right_and_an_off_by_one_wrong(demo):
    train = read(demo / "train.jsonl")
    prompts = [row["messages"][0]["content"] for row in train]
    solutions = [row["messages"][1]["content"] for row in train]
    answers = [solution.split()[-1] for solution in solutions]
    rows = [f"train.jsonl, row {i} (0-based)" for i in range(len(train))]
    rewards = load_rewards([{"name": "correct", "function": "math"}])
    total, _ = score(rewards, prompts, solutions, answers, [{}] * len(train), rows)
    assert total.tolist() == [1.0] * len(train)
    wrong = [str(int(answer) + 1) for answer in answers]  # negative control
    total, _ = score(rewards, prompts, solutions, wrong, [{}] * len(train), rows)
    assert total.tolist() == [0.0] * len(train)
    restated = [solution.rsplit(" = ", 1)[0] for solution in solutions]  # "3 + 4": the question's operands, no answer
    total, _ = score(rewards, prompts, restated, answers, [{}] * len(train), rows)
    assert total.tolist() == [0.0] * len(train)
    # with the end-of-turn text a decoder may leave, and boxed
    total, _ = score(rewards, ["q"] * 2, ["3 + 4 = 7<|im_end|>", "\\boxed{7}"], ["7", "7"], [{}, {}], ["r0", "r1"])
    assert total.tolist() == [1.0, 1.0]


def test_seeded_and_idempotent(demo, tmp_path, monkeypatch):
    again = write_demo(tmp_path / "again", **SIZES)
    for name in ("train.jsonl", "rl_train.jsonl", "rl_eval.jsonl", f"{MODEL}/tokenizer.json", f"{MODEL}/config.json"):
        assert (again / name).read_bytes() == (demo / name).read_bytes(), name
    weights = (again / MODEL / "model.safetensors").read_bytes()
    assert weights == (demo / MODEL / "model.safetensors").read_bytes()
    other = write_demo(tmp_path / "other", **SIZES, seed=1)
    assert (other / "train.jsonl").read_bytes() != (demo / "train.jsonl").read_bytes()  # the seed matters

    def no_writing(*args, **kwargs):
        raise AssertionError("written again although the directory holds the same demo")

    monkeypatch.setattr(rl_math, "write_data", no_writing)
    assert write_demo(tmp_path / "again", **SIZES) == tmp_path / "again"
    with pytest.raises(AssertionError, match="written again"):  # other arguments: written anew
        write_demo(tmp_path / "again", **{**SIZES, "eval_rows": 10})
    with pytest.raises(ValueError, match="only 57600 distinct ones exist"):
        rl_math.problems(57601)


def test_model_directory_loads_through_the_library(demo):
    from transformers import AutoModelForCausalLM

    from veomni_lite.data.sft import generation_eos_ids
    from veomni_lite.models.pretrained import load_tokenizer

    directory = demo / MODEL
    tokenizer = load_tokenizer(directory)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<|im_end|>" and generation_eos_ids(directory) == [end]
    user = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have now?"}]
    rendered = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    assert rendered == f"<|im_start|>user\n{user[0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    for number in range(21):  # every number after a space is one token (a table the tiny model can learn)
        assert len(tokenizer(f" {number}")["input_ids"]) == 1, number
    assert tokenizer.decode(tokenizer("3 + 4 = 7")["input_ids"]) == "3 + 4 = 7"
    model = AutoModelForCausalLM.from_pretrained(str(directory))
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.head_dim) == (64, 2, 4, 16)
    assert config.vocab_size == len(tokenizer) and config.eos_token_id == end
    ids = torch.tensor([tokenizer(rendered)["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_the_distillation_demos_reward_wants_the_result_and_its_teacher_the_students_tokenizer(tmp_path):
    """`examples.distill_math.final_number` scores the last number (the bare expression, which `math` accepts, is
    wrong); the teacher directory is larger and holds the student's tokenizer files."""
    from examples.distill_math import TEACHER, TOKENIZER_FILES, final_number, write_teacher

    assert final_number([""] * 4, ["13 + 6 = 19", "13 + 6", "19", "no number"], ["19"] * 4) == [1.0, 0.0, 1.0, 0.0]
    out = write_demo(tmp_path, sft_rows=8, rl_rows=12, eval_rows=4)
    write_teacher(out, rows=5, hidden_size=64, layers=3)
    rows = [json.loads(line) for line in (out / "teacher_train.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(" = " in r["messages"][1]["content"] for r in rows)
    for name in TOKENIZER_FILES:
        if (out / MODEL / name).is_file():
            assert (out / TEACHER / name).read_bytes() == (out / MODEL / name).read_bytes()
    student, teacher = (json.loads((out / d / "config.json").read_text()) for d in (MODEL, TEACHER))
    assert teacher["num_hidden_layers"] == 3 > student["num_hidden_layers"]
