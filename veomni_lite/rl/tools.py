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
- `run_tool_calls(tools, calls, problems, timeout_s)` -> one `ToolResult` per call and problem: a call naming no tool,
  arguments the function does not take (the model's errors), a function that raises, returns something that is not
  JSON-serializable, or runs over `timeout_s` (in a forked process, killed then; the tool's own failures) gives an
  error text that the model reads as the tool's result ("error: ..."). Nothing a tool or the model does raises here.
- `ToolErrors` (`rl.max_tool_error_rate`): a tool failing on its own is named on the console, rank 0, once per tool and
  kind of error (its first exception on any rank, and its failure rate over the rollout batch's calls); a tool that
  ran at least `MIN_TOOL_CALLS` times in a rollout batch (all ranks) and failed in more than `rl.max_tool_error_rate` of
  them fails the run: a `ToolFailureError` on every rank, naming the tool and its first exception (the decision from
  counts summed over the ranks, so every rank decides alike). The model's errors do not count.
"""

from __future__ import annotations

import inspect
import json
import logging
import multiprocessing
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch

from veomni_lite.config import ConfigError, config_entry
from veomni_lite.data.checks import DataError

__all__ = [
    "MIN_TOOL_CALLS", "Tool", "ToolCall", "ToolErrors", "ToolFailureError", "ToolResult", "load_tools",
    "parse_tool_calls", "run_tool_calls",
]  # fmt: skip

logger = logging.getLogger(__name__)
MIN_TOOL_CALLS = 16  # runs of a tool in a rollout batch (all ranks) before its failure rate can fail the run

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


class ToolResult(NamedTuple):
    """What a call gave: the tool's name ("error" for a block that did not parse), the text the model reads, and
    `failure`: for a call that ran (`ran`), the tool's own failure ("Kind: message"; "" when it succeeded)."""

    name: str
    text: str
    ran: bool = False
    failure: str = ""

    @property
    def error(self) -> bool:
        """Whether the model reads an error: its call did not run (the model's error) or the tool failed."""
        return not self.ran or bool(self.failure)


class ToolFailureError(DataError):
    """A tool failed on its own in more than `rl.max_tool_error_rate` of its calls of a rollout batch."""


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


def run_tool(tool: Tool, arguments: dict[str, Any], timeout_s: float) -> tuple[str, str]:
    """(result text, the failure "Kind: message" or "") of one call, run in a forked process killed after
    `timeout_s`."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(tool.fn, arguments, send), daemon=True)
    process.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            status, text = receive.recv()
        else:
            status, text = "error", f"Timeout: {tool.name} ran over rl.tool_timeout_s = {timeout_s:g} s and was stopped"
    except EOFError:
        status, text = "error", f"Exit: {tool.name} exited without a result"
    finally:
        receive.close()
        if process.is_alive():
            process.kill()
        process.join()
    return (text, "") if status == "ok" else (f"error: {text}", text)


def run_tool_calls(
    tools: Sequence[Tool], calls: Sequence[ToolCall], problems: Sequence[str], timeout_s: float
) -> list[ToolResult]:
    """One `ToolResult` per call, then per problem; never raises (see above). Its text starts with "error: " for every
    error, the model's and the tool's."""
    by_name = {t.name: t for t in tools}
    results: list[ToolResult] = []
    for call in calls:
        tool = by_name.get(call.name)
        if tool is None:
            results.append(
                ToolResult(call.name, f"error: no tool named {call.name!r}; the tools are {sorted(by_name)}")
            )
            continue
        try:
            inspect.signature(tool.fn).bind(**call.arguments)
        except TypeError as exc:  # the model's arguments, not the tool: not run
            results.append(ToolResult(call.name, f"error: TypeError: {call.name}(): {exc}"))
            continue
        text, failure = run_tool(tool, call.arguments, timeout_s)
        results.append(ToolResult(call.name, text, True, failure))
    for problem in problems:
        results.append(
            ToolResult("error", f'error: the tool call {problem[:200]!r} is not JSON {{"name", "arguments"}}')
        )
    return results


@dataclass
class ToolErrors:
    """The tools' own failures against `max_rate` (`rl.max_tool_error_rate`, in [0, 1]: `RLConfig.validate_multi_turn`
    checks it; see the module docstring). `reported`: the (tool, kind of error) pairs already named on the console."""

    tools: Sequence[Tool]
    max_rate: float = 0.5
    reported: set[tuple[str, str]] = field(default_factory=set)

    def check(self, runs: Sequence[tuple[str, str]], group: Any = None, log: bool = True, where: str = "") -> None:
        """Collective on every rank of `group`: this rank's (tool name, failure or "") `runs` of a rollout batch summed
        over the ranks (one SUM all-reduce); the kinds of failure no rank had met before gathered (an all-gather, only
        in a batch where some rank met one: every rank learns it from the sum) and named on the console (`log`: rank
        0); a `ToolFailureError` (prefixed `where`) on every rank when a tool fails too often (one `agree` more)."""
        from veomni_lite.distributed.collectives import agree, all_gather_objects, all_reduce

        new: dict[tuple[str, str], str] = {}  # this rank's first failure of each (tool, kind) not yet named
        for name, failure in runs:
            key = (name, failure.split(":", 1)[0])
            if failure and key not in self.reported:
                new.setdefault(key, failure)
        reduced = all_reduce(torch.cat([self.counts(runs).flatten(), torch.tensor([float(len(new))])]), "sum", group)
        totals = reduced[:-1].view(-1, 2)
        if reduced[-1] > 0:
            index = {t.name: i for i, t in enumerate(self.tools)}
            for (name, kind), failure in [item for met in all_gather_objects(new, group) for item in met.items()]:
                if (name, kind) in self.reported:  # another rank's, just named
                    continue
                self.reported.add((name, kind))  # alike on every rank: the gathered kinds are everyone's
                done, failed = (int(x) for x in totals[index[name]].tolist())
                if log:
                    logger.warning(
                        f"tool {name} ({self.tools[index[name]].where}) failed: {failure} (the first {kind} of this "
                        f"tool; {failed} of its {done} calls in this rollout batch failed, all ranks; the run stops "
                        f"above rl.max_tool_error_rate = {self.max_rate:g} once it ran {MIN_TOOL_CALLS} times in one)"
                    )
        failing, account = self.failing(runs, totals)
        if failing:
            agree(account, ToolFailureError, group, where=where)

    def counts(self, runs: Sequence[tuple[str, str]]) -> torch.Tensor:
        """This rank's [runs, failures] per tool (in `tools`' order) of its (tool name, failure or "") runs."""
        rows = [[sum(n == t.name for n, _ in runs), sum(n == t.name and bool(f) for n, f in runs)] for t in self.tools]
        return torch.tensor(rows, dtype=torch.float64).reshape(len(self.tools), 2)

    def failing(self, runs: Sequence[tuple[str, str]], totals: torch.Tensor) -> tuple[bool, str | None]:
        """Whether the run fails (from `totals`, alike on every rank) and, when it does, this rank's account of the
        worst tool (None where this rank met no failure of it)."""
        over = [
            (failed / done, i)
            for i, (done, failed) in enumerate(totals.tolist())
            if done >= MIN_TOOL_CALLS and failed / done > self.max_rate
        ]
        if not over:
            return False, None
        _, i = max(over)
        tool = self.tools[i]
        first = next((f for n, f in runs if n == tool.name and f), None)
        if first is None:
            return True, None
        done, failed = (int(x) for x in totals[i].tolist())
        return True, (
            f"tool {tool.name} ({tool.where}) failed in {failed} of its {done} calls of the rollout batch (all ranks), "
            f"more than rl.max_tool_error_rate = {self.max_rate:g}; its first error: {first}"
        )
