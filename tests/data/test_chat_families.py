"""Assistant-only labels under the chat formats of real model families, on small tokenizers written as model
directories here (byte-level BPE with each family's special tokens, its chat template and, where the family ships one,
its generation_config.json), loaded as the trainer loads them. Per sample, exactly each trained assistant message's
content plus the family's end-of-turn token(s) train; the end-of-turn ids come from the directory. A template that
raises is a DataError naming the file and the row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.pydoc_text import train_bpe
from tests.data.test_sft import TEXTS, trained_runs
from veomni_lite.data.checks import DataError
from veomni_lite.data.sft import ChatEncoder, generation_eos_ids, read_sources, to_conversation
from veomni_lite.data.sft_dataset import RowEncoder, SFTDataset
from veomni_lite.loss_keys import IGNORE_INDEX
from veomni_lite.models.pretrained import load_tokenizer

# The families' templates, written after the ones they ship (trimmed to what a text conversation uses).
LLAMA3 = (
    r"{% set loop_messages = messages %}{% for message in loop_messages %}"
    r"{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    r" + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    r"{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
GEMMA = (  # Gemma 1/2: a system message is refused
    r"{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    r"{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    r"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    r"{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    r"{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
GEMMA3 = (  # Gemma 3: a system message is folded into the first user turn
    r"{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    r"{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    r"{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    r"{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    r"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    r"{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    r"{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    r"{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
MISTRAL = (  # Mistral-7B-Instruct v0.2: [INST] ... [/INST] answer</s>
    r"{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    r"{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    r"{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    r"{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    r"{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
QWEN25 = (  # Qwen2.5: ChatML, with a default system prompt where the conversation has none
    r"{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    r"{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    r"<|im_end|>\n' }}"
    r"{%- endif %}{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not "
    r"loop.first) or (message.role == 'assistant' and not message.tool_calls) %}"
    r"{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# family: (template, special tokens, tokenizer settings, generation_config eos tokens or None, end-of-turn tokens)
FAMILIES = {
    "llama3": (
        LLAMA3,
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},  # the base model's eos, as released
        ["<|end_of_text|>", "<|eot_id|>"],
        "<|eot_id|>",
    ),
    "gemma": (
        GEMMA,
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        None,  # only the template says <end_of_turn> ends a turn
        "<end_of_turn>",
    ),
    "gemma3": (
        GEMMA3,
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        ["<eos>", "<end_of_turn>"],
        "<end_of_turn>",
    ),
    "mistral": (
        MISTRAL,
        ("<unk>", "<s>", "</s>"),
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        None,
        "</s>",
    ),
    "qwen2.5": (
        QWEN25,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},  # the base model's eos
        None,
        "<|im_end|>",
    ),
}
SYSTEM = {"role": "system", "content": "You are a bold one"}
TURNS = [
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "General Kenobi"},
    {"role": "user", "content": "What digit is this?"},
    {"role": "assistant", "content": "a handwritten seven"},
    {"role": "user", "content": "You are a bold one"},
    {"role": "assistant", "content": "Hello there"},
]
WHERE = "data.jsonl, row 0 (0-based)"


def trained_text(tokenizer, name: str, answer: str) -> str:
    """What an answer trains as: its content and the family's end-of-turn. Mistral's template writes `' ' + content`
    after `[/INST]`; where the tokenizer merges that space into the content's first token ("Ġa"), the token trains
    whole (the model generates it so), else the lone space token does not."""
    eot = FAMILIES[name][4]
    if name == "mistral" and tokenizer.convert_ids_to_tokens(tokenizer(" " + answer)["input_ids"])[0] != "Ġ":
        return " " + answer + eot
    return answer + eot


def write_family(directory: Path, family: str) -> Path:
    """A model directory's tokenizer files for `family`: tokenizer.json, tokenizer_config.json, chat_template.jinja
    (save_pretrained), and generation_config.json where the family ships one."""
    from transformers import PreTrainedTokenizerFast

    template, specials, settings, generation_eos, _ = FAMILIES[family]
    core = train_bpe(TEXTS * 20, 300, specials)  # the contents start texts: no "Ġword" merge of a first word
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, chat_template=template, **settings)
    tokenizer.save_pretrained(str(directory))
    if generation_eos:
        ids = [core.token_to_id(token) for token in generation_eos]
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return directory


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, write_family(tmp_path_factory.mktemp(request.param.replace(".", "_")), request.param)


def encode(directory: Path, messages: list[dict], **options):
    tokenizer = load_tokenizer(directory)
    encoder = ChatEncoder(tokenizer, model_dir=directory, **options)
    conversation = to_conversation({"messages": messages}, "messages", {}, WHERE)
    encoded = encoder.encode(conversation, [], WHERE)
    return tokenizer, encoder, encoded


def conversation_for(name: str, with_system: bool) -> list[dict]:
    if not with_system:
        return TURNS
    if name in ("gemma", "mistral"):  # they refuse a system message (tested below)
        pytest.skip(f"{name} takes no system message")
    return [SYSTEM, *TURNS]


@pytest.mark.parametrize("with_system", [False, True], ids=["no-system", "system"])
def test_exactly_each_assistant_content_and_the_family_end_of_turn_train(family, with_system):
    name, directory = family
    messages = conversation_for(name, with_system)
    tokenizer, _, encoded = encode(directory, messages)
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    expected = [trained_text(tokenizer, name, answer) for answer in answers]
    assert trained_runs(tokenizer, encoded.input_ids, encoded.labels) == expected
    trained = sum(label != IGNORE_INDEX for label in encoded.labels)
    assert trained == sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in expected)
    if name == "mistral":  # both cases of the space occur
        assert expected[:2] == ["General Kenobi</s>", " a handwritten seven</s>"]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(encoded.input_ids) == rendered, "the tokens are the template's whole rendering"
    if name == "qwen2.5" and not with_system:
        assert "You are Qwen" in rendered, "the default system prompt is there and does not train"
    if name == "gemma3" and with_system:
        assert "<start_of_turn>user\nYou are a bold one\n\nHello there" in rendered, "folded into the first turn"


def test_a_message_marked_not_to_train_does_not_under_any_family(family):
    name, directory = family
    messages = [TURNS[0], {**TURNS[1], "train": False}, *TURNS[2:5], {**TURNS[5], "loss_weight": 0}]
    tokenizer, _, encoded = encode(directory, messages)
    expected = [trained_text(tokenizer, name, "a handwritten seven")]
    assert trained_runs(tokenizer, encoded.input_ids, encoded.labels) == expected
    _, _, everything = encode(directory, messages, train_on_prompt=True)
    assert all(label != IGNORE_INDEX for label in everything.labels)


def test_the_end_of_turn_ids_come_from_the_directory(family):
    name, directory = family
    tokenizer, encoder, _ = encode(directory, TURNS)
    _, _, settings, generation_eos, eot = FAMILIES[name]
    expected = {settings["eos_token"], eot, *(generation_eos or [])}
    assert encoder.end_of_turn == {tokenizer.convert_tokens_to_ids(token) for token in expected}
    assert generation_eos_ids(directory) == [tokenizer.convert_tokens_to_ids(t) for t in generation_eos or []]


def test_gemma_negative_control_without_the_template_probe_the_newline_trains(tmp_path, monkeypatch):
    """The property the tests above check fails as it did before: with only the eos as end-of-turn, Gemma's
    <end_of_turn> and the newline after it train as if they were the answer."""
    directory = write_family(tmp_path, "gemma")
    monkeypatch.setattr(ChatEncoder, "_template_end_of_turn", lambda self: [])
    tokenizer, _, encoded = encode(directory, TURNS[:2])
    assert trained_runs(tokenizer, encoded.input_ids, encoded.labels) == ["General Kenobi<end_of_turn>\n"]


def test_generation_config_eos_ids_int_or_list_and_a_template_that_writes_no_special_token(tmp_path):
    write_family(tmp_path, "mistral")
    plain = r"{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ '\n' }}{% endfor %}"
    tokenizer = load_tokenizer(tmp_path)
    assert ChatEncoder(tokenizer, plain, model_dir=tmp_path).end_of_turn == {tokenizer.eos_token_id}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))  # <unk>'s id: never one
    assert generation_eos_ids(tmp_path) == [0]
    assert ChatEncoder(tokenizer, plain, model_dir=tmp_path).end_of_turn == {tokenizer.eos_token_id}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    assert ChatEncoder(tokenizer, plain, model_dir=tmp_path).end_of_turn == {1, 2}
    (tmp_path / "generation_config.json").write_text("[")
    with pytest.raises(DataError, match=r"generation_config.json is not a JSON object"):
        ChatEncoder(tokenizer, plain, model_dir=tmp_path)


# ---------------------------------------------------------------- a template that raises: the file and the row


@pytest.mark.parametrize(
    ("name", "bad", "message"),
    [
        ("gemma", [SYSTEM, *TURNS[:2]], r"System role not supported"),
        ("gemma", [TURNS[0], TURNS[0], TURNS[1]], r"Conversation roles must alternate"),
        ("mistral", [TURNS[0], TURNS[2], TURNS[1]], r"Conversation roles must alternate"),
        ("mistral", [TURNS[0], SYSTEM, *TURNS[2:4]], r"Only user and assistant roles are supported"),
    ],
    ids=["gemma-system", "gemma-alternate", "mistral-alternate", "mistral-system"],
)
def test_a_template_that_raises_is_a_data_error_naming_the_file_and_the_row(tmp_path, name, bad, message):
    directory = write_family(tmp_path / "model", name)
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"messages": TURNS[:2]}) + "\n\n" + json.dumps({"messages": bad}) + "\n")
    encoder = ChatEncoder(load_tokenizer(directory), model_dir=directory)
    # row 2: a JSON Lines file's rows are its lines, 0-based, the blank one included (so "row N" is line N + 1)
    with pytest.raises(DataError, match=rf"{path}, row 2 \(0-based\): the chat template .* raised .*{message}"):
        SFTDataset(RowEncoder(read_sources(str(path), "data.train_path"), encoder, "messages", {}, 0))


def test_a_template_that_does_not_compile_is_a_data_error_naming_the_row(tmp_path):
    directory = write_family(tmp_path, "qwen2.5")
    with pytest.raises(DataError, match=r"row 0 \(0-based\): the chat template \(data.chat_template\) raised .*Syntax"):
        encode(directory, TURNS, chat_template="{% for message in messages %}")


# ---------------------------------------------------------------- the Rust tokenizer, called directly, gives the same


def tokenizer_call(self, texts: list[str], offsets: list[bool]) -> list[tuple[list[int], list]]:
    """The reference: the tokenizer's own call per text, as `ChatEncoder` tokenized before it called the Rust
    tokenizer directly."""
    out = []
    for text, want in zip(texts, offsets):
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=want)
        out.append((list(encoded["input_ids"]), list(encoded["offset_mapping"]) if want else []))
    return out


def samples(encoder: ChatEncoder, rows: list[dict], fmt: str = "messages") -> list:
    """(ids, labels) of each row, or the error it raises."""
    out = []
    for row in rows:
        try:
            conversation = to_conversation(row, fmt, {}, WHERE)
            encoded = encoder.encode(conversation, [3] * len(conversation.images), WHERE)
            out.append((encoded.input_ids, encoded.labels))
        except DataError as exc:
            out.append(str(exc))
    return out


def same_as_the_tokenizer_call(monkeypatch, tokenizer, rows: list[dict], fmt: str = "messages", **options) -> list:
    """The samples of `rows` through the Rust tokenizer, checked equal to those through the tokenizer's call."""
    fast = ChatEncoder(tokenizer, **options)
    assert fast._backend is not None, "a fast tokenizer is called through its Rust tokenizer"
    got = samples(fast, rows, fmt)
    with monkeypatch.context() as patch:
        patch.setattr(ChatEncoder, "_tokenize", tokenizer_call)
        reference = ChatEncoder(tokenizer, **options)
        assert reference.end_of_turn == fast.end_of_turn
        assert got == samples(reference, rows, fmt)
    return got


CONVERSATIONS = [
    TURNS,
    [SYSTEM, *TURNS],
    [TURNS[0], {**TURNS[1], "train": False}, *TURNS[2:4]],
    [{"role": "user", "content": "Hello <|im_end|> there  \n"}, {"role": "assistant", "content": " a seven\n\n"}],
    [TURNS[0], TURNS[0], TURNS[1]],  # some families refuse it: the same error
]


@pytest.mark.parametrize("train_on_prompt", [False, True], ids=["assistant-only", "train-on-prompt"])
def test_the_rust_tokenizer_gives_the_samples_of_the_tokenizer_call_under_every_family(
    family, train_on_prompt, monkeypatch
):
    name, directory = family
    rows = [{"messages": messages} for messages in CONVERSATIONS]
    got = same_as_the_tokenizer_call(
        monkeypatch, load_tokenizer(directory), rows, model_dir=directory, train_on_prompt=train_on_prompt
    )
    assert sum(isinstance(sample, tuple) for sample in got) >= 3


def test_the_rust_tokenizer_on_the_shipped_help_pages_chatml_images_and_text(tmp_path, monkeypatch):
    """Every row of the demo's help pages (`sft_demo.write_help`: long, varied paragraphs) with its own tokenizer,
    ChatML with image parts, and the text format: identical samples through either call."""
    from examples.sft_demo import write_help, write_tokenizer

    texts = write_help(tmp_path / "help")
    write_tokenizer(tmp_path / "model", texts, vocab_size=2048)
    tokenizer = load_tokenizer(tmp_path / "model")
    rows = [json.loads(line) for line in (tmp_path / "help" / "train.jsonl").read_text().splitlines()]
    assert len(rows) > 2000
    same_as_the_tokenizer_call(monkeypatch, tokenizer, rows, "sharegpt")
    same_as_the_tokenizer_call(monkeypatch, tokenizer, rows[:200], "sharegpt", train_on_prompt=True)
    image = {"type": "image"}
    pictured = [
        {"messages": [{"role": "user", "content": [image, {"type": "text", "text": text}]}, TURNS[1]], "images": [1]}
        for text in texts[:50]
    ]
    got = same_as_the_tokenizer_call(
        monkeypatch, tokenizer, pictured, chat_template="chatml", image_token="<|image_pad|>"
    )
    assert all(ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 3 for ids, _ in got)
    same_as_the_tokenizer_call(monkeypatch, tokenizer, [{"text": text} for text in texts[:200]], "text")


def test_the_rust_tokenizer_is_set_up_as_the_tokenizer_call_sets_its_own(tmp_path, monkeypatch):
    """A tokenizer.json that truncates (as some ship) and `split_special_tokens`: the tokenizer's call turns truncation
    off and splits the special tokens; so does the copy `ChatEncoder` calls. Negative control: the Rust tokenizer as
    loaded truncates, so calling it unconfigured would give other samples."""
    from transformers import PreTrainedTokenizerFast

    core = train_bpe(TEXTS * 20, 300, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    core.enable_truncation(4)
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>").save_pretrained(str(tmp_path))
    tokenizer = load_tokenizer(tmp_path)
    assert len(tokenizer.backend_tokenizer.encode("Hello there General Kenobi").ids) == 4, "the control truncates"
    rows = [{"messages": messages} for messages in CONVERSATIONS]
    got = same_as_the_tokenizer_call(monkeypatch, tokenizer, rows, chat_template="chatml")
    assert max(len(ids) for ids, _ in got) > 20
    tokenizer.split_special_tokens = True
    split = same_as_the_tokenizer_call(monkeypatch, tokenizer, rows, chat_template="chatml", train_on_prompt=True)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in split[0][0], "the special tokens are split"
