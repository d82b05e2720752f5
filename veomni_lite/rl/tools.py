"""Tools an RL policy may call in an episode (`rl.tools`): loaded, described, parsed from the model's text, run.

Contract:
- `load_tools(specs, base_dir)`: one `Tool` per entry of `rl.tools`, each `path/to/file.py:function` or
  `{function: path/to/file.py:function, name: other_name}` (a relative path resolves against `base_dir`, the file is
  executed like a reward file: `veomni_lite.rl.rewards`). A tool is a plain, stateless Python function with type hints
  and a Google-style docstring (`Args:`); its JSON schema is transformers' `get_json_schema`, which the prompt and
  every later turn pass to `apply_chat_template(tools=...)`. A bad entry (a missing file or function, an unknown key,
  a function the schema cannot describe, a duplicate name) is a `ConfigError` naming `rl.tools[i]`.
- `parse_tool_calls(text)` -> (calls, problems): Qwen2.5/Qwen3/Hermes `<tool_call>{"name", "arguments"}</tool_call>`
  blocks (any number), else Llama-3's JSON call (the whole turn one object `{"name", "parameters" | "arguments"}`,
  optionally after `<|python_tag|>`). A block that is not such JSON is a problem (its text), not an exception.
- `run_tool_calls(tools, calls, problems, timeout_s)` -> one result text per call and problem, and the error count: a
  call naming no tool, arguments the function does not take, a function that raises, returns something that is not
  JSON-serializable, or runs over `timeout_s` (in a forked process, killed then) gives an error text that the model
  reads as the tool's result ("error: ..."). Nothing a tool or the model does raises here.
"""

from __future__ import annotations

import json
import multiprocessing
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from veomni_lite.config import ConfigError, config_entry

__all__ = ["Tool", "ToolCall", "load_tools", "parse_tool_calls", "run_tool_calls"]

_KEYS = ("function", "name")
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    """A loaded tool: `name` (what the model calls), the function, its JSON schema and `where` (file:function)."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    where: str


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


def load_tools(specs: Sequence[Any], base_dir: str | Path = ".", key: str = "rl.tools") -> list[Tool]:
    """One `Tool` per entry (see the module docstring)."""
    from transformers.utils import get_json_schema

    from veomni_lite.rl.rewards import user_object

    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
        raise ConfigError(f"{key}: expected a list of 'path/file.py:function' entries, got {type(specs).__name__}")
    modules: dict[Path, ModuleType] = {}
    tools: list[Tool] = []
    for index, spec in enumerate(specs):
        at = f"{key}[{index}]"
        spec = config_entry(at, spec, "function", _KEYS, "a tool entry")
        fn, where = user_object(at, spec["function"], Path(base_dir), modules)
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # noqa: BLE001 - transformers' TypeError / DocstringParsingException
            raise ConfigError(
                f"{at}.function: {where} cannot be described as a tool ({type(exc).__name__}: {exc}); give it type "
                "hints and a docstring with an Args: section"
            ) from None
        name = spec.get("name", schema["function"]["name"])
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
            raise ConfigError(f"{at}.name: {name!r} is not a tool name (letters, digits, '_', '.', '-')")
        if any(t.name == name for t in tools):
            raise ConfigError(f"{at}: a second tool named {name!r}; tool names must be unique (set `name`)")
        schema["function"]["name"] = name
        tools.append(Tool(name, fn, schema, where))
    return tools


def _call_of(payload: Any) -> ToolCall | None:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return ToolCall(payload["name"], arguments) if isinstance(arguments, dict) else None


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The calls in a model turn's `text`, and the blocks that looked like calls but did not parse (see above)."""
    calls: list[ToolCall] = []
    problems: list[str] = []
    blocks = _BLOCK.findall(text)
    if blocks:
        for block in blocks:
            try:
                call = _call_of(json.loads(block.strip()))
            except json.JSONDecodeError:
                call = None
            if call is None:
                problems.append(block.strip())
            else:
                calls.append(call)
        return calls, problems
    stripped = text.strip().removeprefix("<|python_tag|>").strip()
    if stripped.startswith("{") and stripped.endswith("}"):
        try:
            call = _call_of(json.loads(stripped))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
    return calls, problems


def _child(fn: Callable[..., Any], arguments: dict[str, Any], pipe: Any) -> None:
    try:
        value = fn(**arguments)
        out = value if isinstance(value, str) else json.dumps(value)
        pipe.send(("ok", out))
    except BaseException as exc:  # noqa: BLE001 - any failure is the tool's result
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        pipe.close()


def run_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> tuple[str, bool]:
    """(result text, whether it is an error) of one call, run in a forked process killed after `timeout_s`."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(tool.fn, arguments, send), daemon=True)
    process.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            status, text = receive.recv()
        else:
            status, text = "error", f"{tool.name} ran over rl.tool_timeout_s = {timeout_s:g} s and was stopped"
    except EOFError:
        status, text = "error", f"{tool.name} exited without a result"
    finally:
        receive.close()
        if process.is_alive():
            process.kill()
        process.join()
    return (text, False) if status == "ok" else (f"error: {text}", True)


def run_tool_calls(
    tools: Sequence[Tool], calls: Sequence[ToolCall], problems: Sequence[str], timeout_s: float
) -> tuple[list[tuple[str, str]], int]:
    """([(tool name or "error", result text)] per call then per problem, errors); never raises (see above)."""
    by_name = {t.name: t for t in tools}
    results: list[tuple[str, str]] = []
    errors = 0
    for call in calls:
        tool = by_name.get(call.name)
        if tool is None:
            results.append((call.name, f"error: no tool named {call.name!r}; the tools are {sorted(by_name)}"))
            errors += 1
            continue
        text, failed = run_tool(tool, call.arguments, timeout_s)
        results.append((call.name, text))
        errors += failed
    for problem in problems:
        results.append(("error", f'error: the tool call {problem[:200]!r} is not JSON {{"name", "arguments"}}'))
        errors += 1
    return results, errors
