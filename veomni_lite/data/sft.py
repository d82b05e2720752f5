"""Supervised fine-tuning data from the files users already have: read, convert, template, label, cut to length.

- Files (`read_sources`): a file, a directory, a glob, or a list of them; `.jsonl`/`.json` (read with `json`),
  `.parquet` (pyarrow, by row group), `.arrow` files and `save_to_disk` directories (`datasets`, memory-mapped),
  from local disk only, lazily: each rank reads its share of the rows (`Source.read`).
- Formats (`to_conversation`): `messages` (OpenAI `role`/`content`; content a string or typed parts, `{"type":
  "image"}` among them; tool calling as transformers takes it: an assistant message's `tool_calls` (`[{"type":
  "function", "function": {"name", "arguments"}}]`, arguments a dict or OpenAI's JSON string), `tool` messages (with
  `name` / `tool_call_id` where the data has them) and the row's `tools` column (JSON schemas, or their JSON text),
  all handed to the chat template as they are: `apply_chat_template(messages, tools=...)`), `sharegpt`
  (`conversations` of `from`/`value`), `alpaca` (`instruction`, `input`, `output`, optional `system` and `history`),
  `prompt_completion` (strings or message lists), `text` (plain language modelling).
  Column and role names come from `data.columns`. Images: an `images` column of paths (relative to `data.media_dir`,
  default the data file's directory), bytes, or `{"bytes", "path"}` dicts, placed by `<image>` in the text or by
  typed parts, in order.
- Labels (`ChatEncoder`): the conversation is rendered with the tokenizer's chat template prefix by prefix; of the
  text an assistant turn adds after the generation prompt, exactly its content and the end-of-turn token(s) after it
  train (from the token holding the content's first character through the end-of-turn run; markup before the
  content and whatever follows the end-of-turn, such as Gemma's newline, do not; an assistant turn's tool calls,
  written by the template after its content, train with it, and a turn of tool calls alone trains from the start of
  its text after the generation prompt), unless the message says `train: false` or `loss_weight: 0`; everything
  else, and every image placeholder token, is IGNORE_INDEX. The end-of-turn
  ids come from the model directory, never a list of known names: the tokenizer's eos, `generation_config.json`'s
  `eos_token_id` (an int or a list), and the special token(s) the template writes right after an assistant's content
  (found by rendering a probe conversation). `train_on_prompt` trains every token but image placeholders. A template
  that raises (`raise_exception`, e.g. "roles must alternate", or any error inside it) or whose rendering of a prefix
  is not a prefix of the next rendering is an error naming the row. Prefixes are cut only around assistant turns:
  the turns between two of them (a tool result, say, which Qwen2.5 merges with the next tool result into one user
  turn) render as one piece, so `tool` turns never train (but under `train_on_prompt`).
Every problem is a `DataError` naming the file and the row, `row N (0-based)`: the row's index within its file as
read; in a JSON Lines file, row N is line N + 1 (a blank line holds no sample but is counted). A JSON parse error adds
the 1-based column where the line's text breaks.
Nothing read from a dataset runs code.
"""

from __future__ import annotations

import copy
import glob as globbing
import io
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from veomni_lite.data.checks import DataError
from veomni_lite.loss_keys import IGNORE_INDEX

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")
FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
IMAGE_PLACEHOLDER = "<image>"
DEFAULT_COLUMNS = {
    "messages": "messages",
    "role": "role",
    "content": "content",
    "conversations": "conversations",
    "from": "from",
    "value": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "system_tag": "system",
    "system": "system",
    "instruction": "instruction",
    "input": "input",
    "output": "output",
    "history": "history",
    "prompt": "prompt",
    "completion": "completion",
    "text": "text",
    "images": "images",
    "tools": "tools",
}
ROLES = ("system", "user", "assistant", "tool")
TOOL_KEYS = ("tool_calls", "name", "tool_call_id")  # a message's keys handed to the template beside role and content

# ChatML, for a tokenizer without a template of its own (`data.chat_template: chatml`). Image parts render as the
# model's image placeholder (`image_token`, passed by the encoder). Tools as Qwen2.5 writes them (what
# `veomni_lite.rl.tools.parse_tool_calls` reads): `tools=` in the system turn (after the system message, if any), an
# assistant's `tool_calls` as `<tool_call>` blocks after its content, consecutive `tool` turns as one user turn of
# `<tool_response>` blocks; a conversation without them renders as plain ChatML.
CHATML = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\n<tools>{% for tool in tools %}{{ '\\n' }}"
    "{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function "
    'name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "<|im_start|>user{% endif %}{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ image_token }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    '<tool_call>\n{"name": "{{ call[\'name\'] }}", "arguments": {{ call[\'arguments\'] | tojson }}}\n</tool_call>'
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class Turn:
    role: str
    parts: list[str | None]  # text, or None for an image
    train: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # the message's TOOL_KEYS, for the template


@dataclass
class Conversation:
    turns: list[Turn]
    images: list[Any] = field(default_factory=list)
    plain_text: bool = False  # the `text` format: no template, every token trains
    tools: list[dict[str, Any]] | None = None  # the row's tool schemas (`tools=` of the chat template)


def expand_paths(spec: str | Sequence[str], key: str) -> list[Path]:
    """Every data file or `save_to_disk` directory named by `spec` (files, directories, globs), sorted per entry."""
    entries = [spec] if isinstance(spec, str) else list(spec)
    found: list[Path] = []
    for entry in entries:
        path = Path(entry)
        if any(char in entry for char in "*?["):
            matches = sorted(Path(p) for p in globbing.glob(entry, recursive=True))
            if not matches:
                raise DataError(f"{key}: {entry!r} matches no file")
            found += [p for p in matches if p.suffix in FILE_KINDS or _is_saved_dataset(p)]
        elif _is_saved_dataset(path) or path.is_file():
            found.append(path)
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in FILE_KINDS)
            if not files:
                raise DataError(f"{key}: directory {entry!r} holds no {sorted(FILE_KINDS)} file")
            found += files
        else:
            raise DataError(f"{key}: {entry!r} does not exist")
    if not found:
        raise DataError(f"{key}: no data file given")
    return found


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def row_name(path: str | Path, row: int) -> str:
    """How every message names a row: its 0-based index within the file (what `where` strings hold). In a JSON
    Lines file that is its line, blank lines included: row N is line N + 1 of the file."""
    return f"{path}, row {row} (0-based)"


def _kind(path: Path) -> str:
    """How `path` reads: jsonl, json, parquet, arrow or saved (a `save_to_disk` directory)."""
    if _is_saved_dataset(path):
        return "saved"
    if path.suffix not in FILE_KINDS:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; use one of {sorted(FILE_KINDS)}")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    if path.suffix == ".json":  # a JSON array, or JSON Lines under a .json name
        with path.open("rb") as handle:
            return "json" if handle.read(4096).lstrip().startswith(b"[") else "jsonl"
    return path.suffix[1:]


class Source:
    """One data file (or `save_to_disk` directory), read lazily: `identity()` costs a `stat`; `num_rows` and
    `read(start, stop)` read the file (JSON Lines by line, parquet by row group, Arrow memory-mapped), so a rank
    reads only its share. Row N of a JSON Lines file is its line N + 1 (blank lines are no sample)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.kind = _kind(path)
        self._rows: Any = None  # the opened reader (not on a cache hit)
        self._num_rows: int | None = None

    def identity(self) -> list[Any]:
        """What the cache key reads of the file: its path, size and modification time (every file of a directory)."""
        files = sorted(p for p in self.path.rglob("*") if p.is_file()) if self.path.is_dir() else [self.path]
        return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]

    def _open(self) -> Any:
        if self._rows is not None:
            return self._rows
        import datasets

        datasets.disable_progress_bars()
        try:
            if self.kind == "saved":
                rows = datasets.load_from_disk(str(self.path))
                if isinstance(rows, datasets.DatasetDict):
                    raise DataError(f"{self.path}: a DatasetDict ({sorted(rows)}); point data.train_path at one split")
                self._rows, self._num_rows = rows.with_format("arrow"), len(rows)
            elif self.kind == "arrow":
                rows = datasets.Dataset.from_file(str(self.path))
                self._rows, self._num_rows = rows.with_format("arrow"), len(rows)
            elif self.kind == "parquet":
                import pyarrow.parquet as pq

                self._rows = pq.ParquetFile(str(self.path))
                self._num_rows = self._rows.metadata.num_rows
            elif self.kind == "json":
                self._rows = json.loads(self.path.read_text(encoding="utf-8"))
                if not isinstance(self._rows, list):
                    raise DataError(f"{self.path}: a JSON file holds a list of rows, not a {type(self._rows).__name__}")
                self._num_rows = len(self._rows)
            else:
                self._rows, self._num_rows = self.path, _count_lines(self.path)
        except DataError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the reader says, name the file
            raise DataError(f"{self.path}: cannot read it as {self.kind}: {exc}") from exc
        if self._num_rows == 0:
            raise DataError(f"{self.path}: no rows")
        return self._rows

    def close(self) -> None:
        """Let go of the opened reader (a JSON file's rows, say); `read` opens it again."""
        self._rows = None

    @property
    def num_rows(self) -> int:
        self._open()
        assert self._num_rows is not None
        return self._num_rows

    def read(self, start: int, stop: int, batch: int = 256) -> Iterator[tuple[int, dict[str, Any]]]:
        """(row index, row) for the rows in [start, stop); images stay undecoded (paths, bytes, {bytes, path})."""
        rows = self._open()
        if self.kind == "jsonl":
            yield from _read_lines(self.path, start, stop)
        elif self.kind == "json":
            for index in range(start, stop):
                yield index, rows[index]
        elif self.kind == "parquet":
            at = 0
            for group in range(rows.num_row_groups):
                size = rows.metadata.row_group(group).num_rows
                if at + size > start and at < stop:
                    for chunk in rows.iter_batches(batch_size=batch, row_groups=[group]):
                        for offset, row in enumerate(chunk.to_pylist()):
                            if start <= at + offset < stop:
                                yield at + offset, row
                        at += chunk.num_rows
                else:
                    at += size
        else:
            for first in range(start, stop, batch):
                table = rows[first : min(first + batch, stop)]
                for offset, row in enumerate(table.to_pylist()):
                    yield first + offset, row


_CHUNK = 1 << 24


def _count_lines(path: Path) -> int:
    """Lines of a text file (a last line without a newline counts)."""
    count, last = 0, b"\n"
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            count, last = count + chunk.count(b"\n"), chunk[-1:]
    return count + (last != b"\n")


def _line_offset(path: Path, line: int) -> int:
    """The byte offset where line `line` (0-based) starts."""
    import numpy

    seen = position = 0
    with path.open("rb") as handle:
        while line > seen and (chunk := handle.read(_CHUNK)):
            newlines = chunk.count(b"\n")
            if seen + newlines >= line:
                ends = numpy.flatnonzero(numpy.frombuffer(chunk, dtype=numpy.uint8) == 10)
                return position + int(ends[line - seen - 1]) + 1
            seen, position = seen + newlines, position + len(chunk)
    return position


def _read_lines(path: Path, start: int, stop: int) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("rb") as handle:
        handle.seek(_line_offset(path, start))
        for index in range(start, stop):
            line = handle.readline()
            if not line.strip():
                continue
            try:
                yield index, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{row_name(path, index)}: malformed JSON, {_json_column(line, exc)}") from None


def _json_column(line: bytes, exc: json.JSONDecodeError) -> str:
    """Where in `line` the text breaks, as "column C: json's reason" (1-based, in characters); json places a break
    at the end of the line past its newline (a missing closing brace), which is named as the end of the line."""
    end = len(line.decode("utf-8", errors="replace").rstrip())
    if exc.pos < end:
        return f"column {exc.pos + 1}: {exc.msg}"
    return f"column {end + 1} (the end of the line): {exc.msg}"


def read_sources(spec: str | Sequence[str], key: str) -> list[Source]:
    """Every file `spec` names (`expand_paths`), opened lazily (see `Source`)."""
    return [Source(path) for path in expand_paths(spec, key)]


# ---------------------------------------------------------------- formats -> one conversation shape


def _text_parts(text: Any, where: str, what: str) -> list[str | None]:
    """A string with `<image>` placeholders, or typed parts, as text pieces and None for each image."""
    if isinstance(text, str):
        pieces = text.split(IMAGE_PLACEHOLDER)
        parts: list[str | None] = []
        for index, piece in enumerate(pieces):
            if index:
                parts.append(None)
            if piece:
                parts.append(piece)
        return parts
    if isinstance(text, list):
        parts = []
        for part in text:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts += _text_parts(part.get("text") or "", where, what)
            elif kind in ("image", "image_url"):
                parts.append(None)
            else:
                raise DataError(f"{where}: {what} has a part {part!r}; expected {{'type': 'text' | 'image', ...}}")
        return parts
    raise DataError(f"{where}: {what} is a {type(text).__name__}; expected a string or a list of typed parts")


def _column(row: Mapping[str, Any], name: str, where: str, required: bool = True) -> Any:
    if name not in row or (required and row[name] is None):
        if required:
            raise DataError(f"{where}: missing column {name!r} (the row has {sorted(row)})")
        return None
    return row[name]


def to_conversation(row: Mapping[str, Any], fmt: str, columns: Mapping[str, str], where: str) -> Conversation:
    """One row of `fmt` as a conversation (roles system / user / assistant), or a DataError naming the row."""
    c = {**DEFAULT_COLUMNS, **columns}
    images = _column(row, c["images"], where, required=False) or []
    if not isinstance(images, list):
        images = [images]
    if fmt == "text":
        return Conversation(
            [Turn("assistant", _text_parts(_column(row, c["text"], where), where, "text"))], images, True
        )
    turns: list[Turn] = []
    if fmt == "messages":
        messages = _column(row, c["messages"], where)
        if not isinstance(messages, list):
            raise DataError(f"{where}: column {c['messages']!r} is a {type(messages).__name__}, not a list of messages")
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or c["role"] not in message:
                raise DataError(f"{where}: message {index} has no {c['role']!r}: {message!r}")
            role = message[c["role"]]
            weight = message.get("loss_weight")
            train = message.get("train") is not False and (weight is None or weight != 0)
            content = message.get(c["content"]) or ""  # OpenAI writes a tool-calling turn's content as null
            extra = _tool_keys(message, where, f"message {index}")
            turns.append(Turn(role, _text_parts(content, where, f"message {index}"), train, extra))
    elif fmt == "sharegpt":
        conversations = _column(row, c["conversations"], where)
        if not isinstance(conversations, list):
            raise DataError(f"{where}: column {c['conversations']!r} is not a list of turns")
        tags = {c["user_tag"]: "user", c["assistant_tag"]: "assistant", c["system_tag"]: "system"}
        system = _column(row, c["system"], where, required=False)
        if system:
            turns.append(Turn("system", [system]))
        for index, turn in enumerate(conversations):
            tag = turn.get(c["from"]) if isinstance(turn, Mapping) else None
            if tag not in tags:
                raise DataError(
                    f"{where}: turn {index} has role {tag!r}; expected one of {sorted(tags)} (data.columns)"
                )
            turns.append(Turn(tags[tag], _text_parts(turn.get(c["value"], ""), where, f"turn {index}")))
    elif fmt == "alpaca":
        system = _column(row, c["system"], where, required=False)
        if system:
            turns.append(Turn("system", [system]))
        for index, pair in enumerate(_column(row, c["history"], where, required=False) or []):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise DataError(f"{where}: history entry {index} is {pair!r}; expected [instruction, response]")
            turns += [
                Turn("user", _text_parts(pair[0], where, "history")),
                Turn("assistant", _text_parts(pair[1], where, "history")),
            ]
        instruction = _column(row, c["instruction"], where)
        extra = _column(row, c["input"], where, required=False)
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        turns += [
            Turn("user", _text_parts(prompt, where, "instruction")),
            Turn("assistant", _text_parts(_column(row, c["output"], where), where, "output")),
        ]
    elif fmt == "prompt_completion":
        for column, role in ((c["prompt"], "user"), (c["completion"], "assistant")):
            value = _column(row, column, where)
            if isinstance(value, list) and value and isinstance(value[0], Mapping) and "role" in value[0]:
                turns += to_conversation({c["messages"]: value}, "messages", columns, where).turns
            else:
                turns.append(Turn(role, _text_parts(value, where, column)))
    else:
        raise DataError(f"data.format: {fmt!r} is not one of {list(FORMATS)}")
    for index, turn in enumerate(turns):
        if turn.role not in ROLES:
            raise DataError(
                f"{where}: message {index} has the unknown role {turn.role!r}; expected one of {list(ROLES)}"
            )
    return Conversation(turns, images, tools=_tools(_column(row, c["tools"], where, required=False), where, c))


def _json_value(value: Any, where: str, what: str) -> Any:
    """`value`, or the JSON its text holds (OpenAI's arguments, a `tools` column stored as text)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: {what} is text but not JSON ({exc.msg} at character {exc.pos})") from None


def _tool_keys(message: Mapping[str, Any], where: str, what: str) -> dict[str, Any]:
    """The message's TOOL_KEYS that are set, `tool_calls` checked: a list of `{"function": {"name", "arguments"}}`
    (or `{"name", "arguments"}`), arguments a dict or its JSON text (made a dict, as templates expect)."""
    extra = {key: message[key] for key in TOOL_KEYS if message.get(key) is not None}
    calls = extra.get("tool_calls")
    if calls is None:
        return extra
    if not isinstance(calls, list):
        raise DataError(f"{where}: {what}'s tool_calls is a {type(calls).__name__}; expected a list of calls")
    checked = []
    for index, call in enumerate(calls):
        at = f"{what}'s tool_calls[{index}]"
        inner = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(inner, Mapping) or not isinstance(inner.get("name"), str):
            raise DataError(f'{where}: {at} is {call!r}; expected {{"function": {{"name", "arguments"}}}}')
        arguments = _json_value(inner.get("arguments", {}), where, f"{at}.arguments")
        if not isinstance(arguments, Mapping):
            raise DataError(f"{where}: {at}.arguments is {arguments!r}; expected an object of arguments")
        function = {**inner, "arguments": dict(arguments)}
        checked.append(
            {**call, "function": function} if "function" in call else {"type": "function", "function": function}
        )
    extra["tool_calls"] = checked
    return extra


def _tools(value: Any, where: str, columns: Mapping[str, str]) -> list[dict[str, Any]] | None:
    """The row's tool schemas (a list of JSON schemas, or its JSON text); None without any."""
    value = _json_value(value, where, f"column {columns['tools']!r}")
    if not value:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, Mapping) for tool in value):
        raise DataError(f"{where}: column {columns['tools']!r} is {value!r}; expected a list of JSON schemas")
    return [dict(tool) for tool in value]


# ---------------------------------------------------------------- images


def image_reference(value: Any, media_dir: Path, where: str) -> dict[str, Any]:
    """What the cache keeps of an image (nothing decoded): `{"path": absolute path, "bytes": None}` for a file, which
    must exist (relative paths are relative to `media_dir`), or `{"path": None, "bytes": the encoded image}` for an
    image held in the data (bytes, a `{"bytes", "path"}` dict, or a PIL image, saved as PNG)."""
    from PIL import Image

    if isinstance(value, Mapping):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"path": None, "bytes": buffer.getvalue()}
    if isinstance(value, (bytes, bytearray)):
        return {"path": None, "bytes": bytes(value)}
    if isinstance(value, str):
        path = Path(value) if Path(value).is_absolute() else media_dir / value
        if not path.is_file():
            raise DataError(f"{where}: image {value!r} does not exist (looked at {path})")
        return {"path": os.path.abspath(path), "bytes": None}  # not resolve(): a stat per path component
    raise DataError(f"{where}: an image is a {type(value).__name__}; expected a path, bytes or {{'bytes', 'path'}}")


def open_image(reference: Mapping[str, Any], where: str, decode: bool = True) -> Any:
    """The image of an `image_reference`: decoded to RGB, or with `decode=False` only its header read (`.size` is
    known, no pixel is); within Pillow's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`)."""
    import warnings

    from PIL import Image

    path, data = reference.get("path"), reference.get("bytes")
    name = f"image {path!r}" if path else "the image bytes"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path) if path else Image.open(io.BytesIO(data))
            if decode:
                image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise DataError(f"{where}: {name} is over Pillow's decompression-bomb limit: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - name the image whatever Pillow says
        raise DataError(f"{where}: {name} does not decode: {exc}") from None
    return image.convert("RGB") if decode else image


# ---------------------------------------------------------------- template + labels


def _content(parts: list[str | None]) -> str | list[dict[str, str]]:
    """A plain string when there is no image (what every template reads), else typed parts."""
    if all(part is not None for part in parts):
        return "".join(parts)
    return [{"type": "image"} if part is None else {"type": "text", "text": part} for part in parts]


def _messages(turns: list[Turn]) -> list[dict[str, Any]]:
    return [{"role": t.role, "content": _content(t.parts), **t.extra} for t in turns]


def _prompt_turns(conversation: Conversation) -> list[Turn]:
    """The turns an RL prompt asks: all but a last assistant turn."""
    turns = conversation.turns
    return turns[:-1] if turns and turns[-1].role == "assistant" else turns


PROBE_ANSWER = "veomni-lite probe answer"  # an assistant content no template writes on its own


def override_template(chat_template: str, image_token: str = "") -> str:
    """The Jinja text `data.chat_template` names ('' when unset): ChatML for `chatml`, with the model's image
    placeholder written in where it has one (so the template renders alone, as the export saves it)."""
    if chat_template == "chatml":
        return CHATML.replace("{{ image_token }}", image_token) if image_token else CHATML
    return chat_template


def generation_eos_ids(model_dir: str | Path | None) -> list[int]:
    """`eos_token_id` of the directory's generation_config.json, an int or a list ([] without the file or key); read
    as JSON, nothing run."""
    path = Path(model_dir or "") / "generation_config.json"
    if not model_dir or not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as exc:
        raise DataError(f"model.pretrained_dir: {path} is not a JSON object: {exc}") from None
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def rust_backend(tokenizer: Any) -> Any | None:
    """A copy of a fast tokenizer's Rust tokenizer (`tokenizers.Tokenizer`) set up as `tokenizer(text,
    add_special_tokens=False)` sets its own before each call (no truncation, no padding, its `split_special_tokens`),
    so that its `encode` gives what that call gives; None for a tokenizer class that encodes otherwise (a slow
    one, or one that overrides the call)."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or (
        cls.__call__ is not PreTrainedTokenizerBase.__call__ or cls._encode_plus is not TokenizersBackend._encode_plus
    ):
        return None
    backend = copy.deepcopy(tokenizer.backend_tokenizer)
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = bool(tokenizer.split_special_tokens)
    return backend


def _locate(text: str, content: str) -> tuple[int, int]:
    """Where `content` (or, for a template that trims it, its stripped form) is in `text`; (0, 0) if neither is."""
    for candidate in (content, content.strip()):
        at = text.find(candidate) if candidate else -1
        if at >= 0:
            return at, at + len(candidate)
    return 0, 0


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]  # aligned with input_ids (unshifted: the collator shifts once)
    images: list[Any] = field(default_factory=list)


class ChatEncoder:
    """Tokens and labels of a conversation (see the module docstring). `image_token` is the tokenizer's image
    placeholder token (Qwen2-VL: `<|image_pad|>`), repeated per image by `image_lengths`; `model_dir` is the model
    directory, whose generation_config.json adds end-of-turn ids. `end_of_turn` holds the ids found."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str = "",
        train_on_prompt: bool = False,
        image_token: str = "",
        model_dir: str | Path | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        template = override_template(chat_template, image_token) or tokenizer.chat_template
        if isinstance(template, Mapping):  # several named templates: the default one, as transformers picks
            template = template.get("default")
        if not template:
            raise DataError("the tokenizer has no chat template; set data.chat_template: chatml (or a Jinja template)")
        self.template: str = template
        self.origin = "data.chat_template" if chat_template else "the tokenizer's chat template"
        self.train_on_prompt = train_on_prompt
        self.image_token = image_token
        self.image_token_id = tokenizer.convert_tokens_to_ids(image_token) if image_token else None
        self.special_ids = set(tokenizer.all_special_ids)
        self.special_ids |= {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
        self._backend = rust_backend(tokenizer)
        found = [tokenizer.eos_token_id, *generation_eos_ids(model_dir), *self._template_end_of_turn()]
        self.end_of_turn = {i for i in found if isinstance(i, int) and i != tokenizer.unk_token_id}

    def _template_end_of_turn(self) -> list[int]:
        """The special token(s) the template writes right after an assistant's content (whitespace may come first),
        from a probe conversation; [] if the template writes none or refuses the probe (it then refuses rows too,
        each named)."""
        try:
            text = self._render([Turn("user", ["Hi"]), Turn("assistant", [PROBE_ANSWER])], False, "the probe")
        except DataError:
            return []
        at = text.rfind(PROBE_ANSWER)
        if at < 0:
            return []
        run: list[int] = []
        for token in self._tokenize([text[at + len(PROBE_ANSWER) :]], [False])[0][0]:
            if token in self.special_ids:
                run.append(token)
            elif run or self.tokenizer.decode([token]).strip():
                break
        return run

    @staticmethod
    def prompt_messages(conversation: Conversation) -> list[dict[str, Any]]:
        """The messages `encode_prompt` renders, as the chat template gets them ([] for the `text` format)."""
        return [] if conversation.plain_text else _messages(_prompt_turns(conversation))

    def _render(
        self, turns: list[Turn], generation_prompt: bool, where: str, tools: list[dict[str, Any]] | None = None
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                _messages(turns),
                tools=tools,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                image_token=self.image_token,
            )
        except Exception as exc:  # noqa: BLE001 - the template's raise_exception, or any error inside it
            roles = ", ".join(t.role for t in turns)
            raise DataError(
                f"{where}: the chat template ({self.origin}) raised on the first {len(turns)} message(s) (roles "
                f"{roles}): {type(exc).__name__}: {exc}"
            ) from None

    def _tokenize(self, texts: list[str], offsets: list[bool]) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """(ids, character offsets) of each text, exactly as `tokenizer(text, add_special_tokens=False)` gives them;
        the offsets only where `offsets` asks (else, or for a tokenizer without offsets, []). A fast tokenizer
        calls its Rust tokenizer directly (`rust_backend`; `encode`, not `encode_batch`, whose thread pool would take
        the cores of the other ranks preprocessing beside it), else the tokenizer's own call."""
        if self._backend is not None:
            encodings = [self._backend.encode(text, add_special_tokens=False) for text in texts]
            return [(e.ids, e.offsets if want else []) for e, want in zip(encodings, offsets)]
        out: list[tuple[list[int], list[tuple[int, int]]]] = []
        for text, want in zip(texts, offsets):
            try:
                encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=want)
                out.append((list(encoded["input_ids"]), list(encoded["offset_mapping"]) if want else []))
            except (NotImplementedError, ValueError, KeyError):  # a tokenizer without offsets
                out.append((self.tokenizer(text, add_special_tokens=False)["input_ids"], []))
        return out

    def _answer_mask(self, text: str, content: str, tokens: list[int], offsets: list[tuple[int, int]]) -> list[bool]:
        """Which tokens of the text an assistant turn adds train: from the token holding the content's first
        character through the end-of-turn run that follows the content. Where the content is not in the text
        verbatim (a template that rewrites it) or the tokenizer has no offsets, from the start."""
        start, end = _locate(text, content) if offsets else (0, 0)
        after = [i for i, t in enumerate(tokens) if t in self.end_of_turn and (not offsets or offsets[i][0] >= end)]
        last = after[0] if after else len(tokens) - 1
        while last + 1 < len(tokens) and tokens[last + 1] in self.end_of_turn:
            last += 1
        first = next((i for i, (_, stop) in enumerate(offsets) if stop > start), 0) if start else 0
        return [first <= i <= last for i in range(len(tokens))]

    def encode(self, conversation: Conversation, image_lengths: Sequence[int], where: str) -> Encoded:
        """Token ids and labels; each image placeholder token is repeated `image_lengths[i]` times."""
        placeholders = sum(part is None for turn in conversation.turns for part in turn.parts)
        if placeholders != len(conversation.images):
            raise DataError(
                f"{where}: {placeholders} image placeholder(s) but {len(conversation.images)} image(s); each image "
                f"needs one {IMAGE_PLACEHOLDER} (or a {{'type': 'image'}} part), in order"
            )
        if placeholders and self.image_token_id is None:
            raise DataError(f"{where}: the row has images but the model takes none (not a vision-language model)")
        if conversation.plain_text:
            pieces = [(p if p is not None else self.image_token, True, None) for p in conversation.turns[0].parts]
            pieces.append((self.tokenizer.eos_token or "", True, None))
        else:
            if not any(t.role == "assistant" and t.train for t in conversation.turns) and not self.train_on_prompt:
                raise DataError(
                    f"{where}: no assistant turn to train on (assistant-only labels; or data.train_on_prompt)"
                )
            pieces = self._pieces(conversation.turns, where, conversation.tools)
        ids: list[int] = []
        labels: list[int] = []
        images = iter(image_lengths)
        answers = [trains and answer is not None and not self.train_on_prompt for _, trains, answer in pieces]
        encoded = self._tokenize([text for text, _, _ in pieces], answers)
        for (text, trains, answer), is_answer, (tokens, offsets) in zip(pieces, answers, encoded):
            if is_answer:
                assert answer is not None
                mask = self._answer_mask(text, answer, tokens, offsets)
            else:
                mask = [trains or self.train_on_prompt] * len(tokens)
            for token, train in zip(tokens, mask):
                if token == self.image_token_id:
                    count = next(images)
                    ids += [token] * count
                    labels += [IGNORE_INDEX] * count
                else:
                    ids.append(token)
                    labels.append(token if train else IGNORE_INDEX)
        return Encoded(ids, labels, list(conversation.images))

    def encode_prompt(
        self, conversation: Conversation, image_lengths: Sequence[int], where: str
    ) -> tuple[list[int], str]:
        """(token ids, rendered text) of the prompt an RL row asks: the conversation without its last assistant turn,
        rendered with the generation prompt (the `text` format: the text itself); each image placeholder token is
        repeated `image_lengths[i]` times in the ids."""
        turns = conversation.turns
        if conversation.plain_text:
            text = "".join(p if p is not None else self.image_token for p in turns[0].parts)
        else:
            turns = _prompt_turns(conversation)
            if not turns:
                raise DataError(f"{where}: no prompt: the row has no message before its last assistant turn")
            text = self._render(turns, True, where, conversation.tools)
        placeholders = sum(part is None for turn in turns for part in turn.parts)
        if placeholders != len(image_lengths):
            raise DataError(
                f"{where}: {placeholders} image placeholder(s) in the prompt but {len(image_lengths)} image(s)"
            )
        if placeholders and self.image_token_id is None:
            raise DataError(f"{where}: the row has images but the model takes none (not a vision-language model)")
        ids: list[int] = []
        images = iter(image_lengths)
        for token in self._tokenize([text], [False])[0][0]:
            ids += [token] * (next(images) if token == self.image_token_id else 1)
        return ids, text

    def _pieces(
        self, turns: list[Turn], where: str, tools: list[dict[str, Any]] | None = None
    ) -> list[tuple[str, bool, str | None]]:
        """The rendered text cut before and after each assistant turn (and at the end): (text, trains, the
        assistant's content or None) per piece."""
        pieces: list[tuple[str, bool, str | None]] = []
        done = ""
        for index, turn in enumerate(turns):
            if turn.role == "assistant":
                prompt = self._render(turns[:index], True, where, tools) if index else ""
                if not prompt.startswith(done):
                    raise self._unstable(where, index)
                pieces.append((prompt[len(done) :], False, None))
                done = prompt
            elif index + 1 < len(turns) and turns[index + 1].role != "assistant":
                continue  # no cut between two non-assistant turns (see the module docstring)
            full = self._render(turns[: index + 1], False, where, tools)
            if not full.startswith(done):
                raise self._unstable(where, index)
            answer = turn.role == "assistant" and turn.train
            content = "".join(part for part in turn.parts if part is not None) if None not in turn.parts else ""
            pieces.append((full[len(done) :], answer, content if answer else None))
            done = full
        return [piece for piece in pieces if piece[0]]

    @staticmethod
    def _unstable(where: str, index: int) -> DataError:
        return DataError(
            f"{where}: the chat template is not prefix-stable at message {index} (rendering the first messages is not "
            "a prefix of rendering one more), so the assistant tokens cannot be found; use data.chat_template: chatml "
            "or data.train_on_prompt: true"
        )
