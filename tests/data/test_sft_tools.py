"""Tool-calling conversations in the standard messages shape (an assistant turn's `tool_calls`, `tool` turns, the
row's `tools` schemas), rendered by the model's own chat template: the tokens are the template's whole rendering with
`tools=`, exactly the assistant turns train (their tool calls included) and the tool results never do. Templates:
Qwen2.5's and Qwen3's tool-calling parts, written after the ones they ship, and `data.chat_template: chatml`, on a
small tokenizer written here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from examples.pydoc_text import train_bpe
from tests.data.test_sft import TEXTS, trained_runs
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import CHATML, ChatEncoder, to_conversation
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.pretrained import load_tokenizer

_TOOLS_HEADER = (
    r"{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
    r"function signatures within <tools></tools> XML tags:\n<tools>' }}{%- for tool in tools %}{{- '\n' }}"
    r"{{- tool | tojson }}{%- endfor %}{{- '\n</tools>\n\nFor each function call, return a json object with function "
    r"name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    r"\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
)
_TOOL_TURNS = (  # a tool turn: inside one user turn with the tool turns next to it
    r"{%- elif message.role == 'tool' %}{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    r"{{- '<|im_start|>user' }}{%- endif %}{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    r"{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}{%- endif %}"
    r"{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
QWEN25 = (
    r"{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0]['role'] == 'system' %}"
    r"{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, created by Alibaba Cloud.' }}{%- endif %}"
    + _TOOLS_HEADER
    + r"{%- else %}{%- if messages[0]['role'] == 'system' %}"
    r"{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}"
    r"{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.<|im_end|>\n' }}{%- endif %}{%- endif %}"
    r"{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    r" or (message.role == 'assistant' and not message.tool_calls) %}"
    r"{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    r"{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}{%- if message.content %}"
    r"{{- '\n' + message.content }}{%- endif %}{%- for tool_call in message.tool_calls %}"
    r"{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    r"{{- '\n<tool_call>\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    r"{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}" + _TOOL_TURNS
)
QWEN3 = (  # Qwen3 without its reasoning parts: no default system prompt, arguments written as they are when text
    r"{%- if tools %}{{- '<|im_start|>system\n' }}{%- if messages[0].role == 'system' %}"
    r"{{- messages[0].content + '\n\n' }}{%- endif %}"
    + _TOOLS_HEADER.replace(r"{{- '\n\n# Tools", r"{{- '# Tools")
    + r"{%- else %}{%- if messages[0].role == 'system' %}"
    r"{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}{%- endif %}"
    r"{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    r" %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    r"{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\n' + message.content }}"
    r"{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    r"{%- if (loop.first and message.content) or (not loop.first) %}{{- '\n' }}{%- endif %}"
    r"{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    r"{{- '<tool_call>\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    r"{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    r"{%- endif %}{{- '}\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\n' }}" + _TOOL_TURNS
)
TEMPLATES = {"qwen2.5": QWEN25, "qwen3": QWEN3, "chatml": CHATML}  # chatml: the library's (data.chat_template)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
WHERE = "tools.jsonl, row 0 (0-based)"


def tool_row(arguments_as_text: bool = True) -> dict:
    """Two parallel calls (OpenAI's JSON-text arguments, or dicts), their two results, the answer."""

    def arguments(a: int, b: int):
        return json.dumps({"a": a, "b": b}) if arguments_as_text else {"a": a, "b": b}

    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": arguments(a, b)}}
        for i, (a, b) in enumerate([(1, 2), (30, 4)])
    ]
    return {
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": "You are a bold one"},
            {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_0", "name": "add", "content": "3"},
            {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "34"},
            {"role": "assistant", "content": "General Kenobi 37"},
        ],
    }


def tool_tokenizer(directory: Path, template: str):
    """A small byte-level BPE tokenizer with ChatML's special tokens and `template`, saved and loaded as a model's."""
    from transformers import PreTrainedTokenizerFast

    core = train_bpe(TEXTS * 20 + [QWEN25, json.dumps(TOOLS)], 300, SPECIALS)
    settings = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    PreTrainedTokenizerFast(tokenizer_object=core, chat_template=template, **settings).save_pretrained(str(directory))
    return load_tokenizer(directory)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def family(request, tmp_path_factory) -> tuple[str, object]:
    directory: Path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    return request.param, tool_tokenizer(directory, TEMPLATES[request.param])


def encode(tokenizer, row: dict, **options):
    encoder = ChatEncoder(tokenizer, **options)
    return encoder.encode(to_conversation(row, "messages", {}, WHERE), [], WHERE)


@pytest.mark.parametrize("arguments_as_text", [True, False], ids=["openai-text-arguments", "dict-arguments"])
def test_a_tool_calling_row_renders_with_its_tools_and_trains_exactly_the_assistant_turns(family, arguments_as_text):
    name, tokenizer = family
    row = tool_row(arguments_as_text)
    encoded = encode(tokenizer, row)
    reference = tool_row(arguments_as_text=False)  # transformers' documented shape: arguments as a dict
    reference["messages"][2]["content"] = ""  # OpenAI's null content, as the encoder hands it to the template
    rendered = tokenizer.apply_chat_template(reference["messages"], tools=TOOLS, tokenize=False)
    assert tokenizer.decode(encoded.input_ids) == rendered, "the tokens are the template's whole rendering with tools"
    assert "# Tools" in rendered and '"name": "add"' in rendered and "<tool_response>\n34\n</tool_response>" in rendered
    call = '<tool_call>\n{{"name": "add", "arguments": {{"a": {}, "b": {}}}}}\n</tool_call>'
    calls = call.format(1, 2) + "\n" + call.format(30, 4) + "<|im_end|>"
    assert trained_runs(tokenizer, encoded.input_ids, encoded.labels) == [calls, "General Kenobi 37<|im_end|>"]
    # negative control: the same row with everything trained (train_on_prompt) has the tool results in its labels
    everything = encode(tokenizer, row, train_on_prompt=True)
    assert trained_runs(tokenizer, everything.input_ids, everything.labels) == [rendered]


def test_the_two_tool_results_are_one_user_turn_so_no_cut_is_made_between_them(family):
    """Qwen2.5 and Qwen3 merge consecutive tool turns: rendering the first alone is not a prefix of rendering both;
    the encoder cuts only around assistant turns, so such a row encodes (and its results stay untrained)."""
    _, tokenizer = family
    messages = tool_row(arguments_as_text=False)["messages"]
    messages[2]["content"] = ""
    first = tokenizer.apply_chat_template(messages[:4], tools=TOOLS, tokenize=False)
    both = tokenizer.apply_chat_template(messages[:5], tools=TOOLS, tokenize=False)
    assert not both.startswith(first), "the case this test is about: a cut after the first result would be unstable"
    encoded = encode(tokenizer, tool_row())
    results = [i for i, (t, label) in enumerate(zip(encoded.input_ids, encoded.labels)) if label == IGNORE_INDEX]
    assert "<tool_response>\n3\n</tool_response>\n<tool_response>\n34" in tokenizer.decode(
        [encoded.input_ids[i] for i in results]
    )


def test_a_tool_turn_marked_to_train_or_a_row_without_tools_still_trains_assistant_turns_only(family):
    _, tokenizer = family
    row = tool_row()
    row["messages"][3]["train"] = True  # only assistant turns train, whatever a tool turn says
    encoded = encode(tokenizer, row)
    runs = trained_runs(tokenizer, encoded.input_ids, encoded.labels)
    assert len(runs) == 2 and all("tool_response" not in run for run in runs)
    row = {**tool_row(), "tools": json.dumps(TOOLS)}  # the schemas stored as JSON text (a parquet string column)
    assert encode(tokenizer, row).input_ids == encode(tokenizer, tool_row()).input_ids


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda row: row["messages"][2].update(tool_calls={"name": "add"}), "message 2's tool_calls is a dict"),
        (lambda row: row["messages"][2]["tool_calls"][1].update(function={"arguments": {}}), "tool_calls[1] is"),
        (
            lambda row: row["messages"][2]["tool_calls"][0]["function"].update(arguments="{a: 1"),
            "message 2's tool_calls[0].arguments is text but not JSON",
        ),
        (lambda row: row["messages"][2]["tool_calls"][0]["function"].update(arguments="[1]"), "an object of arguments"),
        (lambda row: row.update(tools={"add": 1}), "column 'tools' is {'add': 1}; expected a list of JSON schemas"),
        (lambda row: row["messages"][3].update(role="function"), "message 3 has the unknown role 'function'"),
    ],
)
def test_a_malformed_tool_calling_row_is_a_data_error_naming_the_row_and_message(change, message):
    row = tool_row()
    change(row)
    with pytest.raises(DataError, match="tools.jsonl, row 0 \\(0-based\\): .*" + re.escape(message)):
        to_conversation(row, "messages", {}, WHERE)


def test_chatml_renders_tools_as_qwen25_does_and_a_conversation_without_them_as_plain_chatml():
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(template: str, messages: list[dict], tools: list[dict] | None = None) -> str:
        return render_jinja_template([messages], tools=tools, chat_template=template)[0][0]

    messages = tool_row(arguments_as_text=False)["messages"]
    messages[2]["content"] = ""
    assert render(CHATML, messages, TOOLS) == render(QWEN25, messages, TOOLS)  # with a system message: no default
    plain = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "General Kenobi"}]
    assert (
        render(CHATML, plain)
        == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\nGeneral Kenobi<|im_end|>\n"
    )
