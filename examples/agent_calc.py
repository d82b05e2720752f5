"""The agent demo's files: multiplications beyond a tiny model, a calculator tool, tool-using SFT transcripts.

`write_demo(out)` writes `calculator.py` (the tool: `calculate(expression)`), `models/qwen2_agent` (a randomly
initialized tiny Qwen2 with a byte-level BPE tokenizer, trained on the SFT conversations as its template renders them;
its ChatML template takes transformers' tool-calling shape, Qwen2.5's way in a compact form for a 400-token vocabulary:
`tools=` as a system turn naming each tool and its parameters, an assistant's `tool_calls` as `<tool_call>{"name",
"arguments"}</tool_call>`, a `tool` turn as a user turn `<tool_response>...</tool_response>`), `sft_train.jsonl` and
`rl_train.jsonl` / `rl_eval.jsonl` (questions with their answers).

`sft_train.jsonl` holds standard tool-calling rows (docs/data.md): the row's `tools` (the calculator's JSON schema, as
`rl.tools` gives it to the template), messages with the assistant's `tool_calls` and the `tool` turn of its result;
nothing in them is written for this template. Two kinds of transcript, drawn at random per row: a fraction
`tool_fraction` (default `TOOL_FRACTION`, 0.3) calls the tool (question, the tool call, its result, the answer) and the
rest answers the product directly. The tiny model cannot multiply, so after SFT it calls
the tool in roughly that fraction of its sampled episodes and the direct answers are mostly wrong: the headroom that RL
with the tool (reward: the exact product) fills by calling it more often.

Usage: python examples/agent_calc.py OUT_DIR
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from examples.sft_demo import write_jsonl
from veomni_lite.rl.tools import load_tools

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
           "</tool_response>")  # fmt: skip
TOOLS_HEADER = 'You can call tools. Write <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Tools:'
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    + TOOLS_HEADER
    + "{% for tool in tools %}{{ '\\n' + tool['function']['name'] }}"
    "({{ tool['function']['parameters']['properties'] | list | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] or '' }}{% for call in message['tool_calls'] or [] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    '<tool_call>{"name": "{{ call[\'name\'] }}", "arguments": {{ call[\'arguments\'] | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_FILE = '''"""The agent demo's calculator tool."""

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("only integers with + - * are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: The expression, e.g. "347 * 28".
    """
    return str(_eval(ast.parse(expression, mode="eval").body))
'''


def question(rng: random.Random) -> tuple[str, str, str]:
    a, b = rng.randint(100, 999), rng.randint(11, 99)
    return f"What is {a} * {b}?", f"{a} * {b}", str(a * b)


def call_text(expression: str) -> str:
    """How the template writes the call of `calculate(expression)` (what the model learns to write)."""
    return '<tool_call>{"name": "calculate", "arguments": {"expression": "' + expression + '"}}</tool_call>'


TOOL_FRACTION = 0.3  # of the SFT transcripts that call the tool; the rest answer directly (see the docstring)


def transcript(rng: random.Random, schema: dict[str, Any], tool: bool = True) -> dict[str, Any]:
    """One SFT row in the standard tool-calling shape (the calculator's `schema` as the row's `tools`): question, the
    assistant's tool call, the tool's result, answer; or, with `tool` False, the question and the answer directly."""
    text, expression, answer = question(rng)
    row: dict[str, Any] = {"tools": [schema], "messages": [{"role": "user", "content": text}]}
    if tool:
        call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
        row["messages"] += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculate", "content": answer},
        ]
    row["messages"].append({"role": "assistant", "content": answer})
    return row


def sft_transcripts(
    rng: random.Random, rows: int, schema: dict[str, Any], tool_fraction: float = TOOL_FRACTION
) -> list[dict[str, Any]]:
    """`rows` SFT rows, each calling the tool with probability `tool_fraction` (else answering directly)."""
    return [transcript(rng, schema, tool=rng.random() < tool_fraction) for _ in range(rows)]


def rendered(rows: list[dict[str, Any]]) -> list[str]:
    """The rows as the demo's template renders them (the text its tokenizer is trained on)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    return [render_jinja_template([row["messages"]], tools=row["tools"], chat_template=TEMPLATE)[0][0] for row in rows]


def write_model(directory: Path, texts: list[str]) -> None:
    """The tiny Qwen2 and its tokenizer (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    from examples.pydoc_text import train_bpe

    core = train_bpe(texts, 400, SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=TEMPLATE
    )
    tokenizer.save_pretrained(str(directory))
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(directory), safe_serialization=True)


def write_demo(
    out: str | Path, sft_rows: int = 2048, rl_rows: int = 256, eval_rows: int = 32, tool_fraction: float = TOOL_FRACTION
) -> Path:
    """Every file of the demo under `out` (see the module docstring; `tool_fraction` of the SFT rows call the tool, the
    rest answer directly); returns `out`."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"write_demo: tool_fraction must be in [0, 1]; got {tool_fraction}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calculator.py").write_text(TOOL_FILE)
    (schema,) = [tool.schema for tool in load_tools([f"{out / 'calculator.py'}:calculate"])]
    rng = random.Random(0)
    sft = sft_transcripts(rng, sft_rows, schema, tool_fraction)
    write_jsonl(out / "sft_train.jsonl", sft)
    for name, count in (("rl_train", rl_rows), ("rl_eval", eval_rows)):
        rows = []
        for _ in range(count):
            text, _, answer = question(rng)
            rows.append({"messages": [{"role": "user", "content": text}], "answer": answer})
        write_jsonl(out / f"{name}.jsonl", rows)
    texts = rendered(sft) + [TOOL_FILE]
    write_model(out / "models/qwen2_agent", texts)
    return out


if __name__ == "__main__":
    print(write_demo(sys.argv[1] if len(sys.argv) > 1 else "outputs/agent_calc_data"))
