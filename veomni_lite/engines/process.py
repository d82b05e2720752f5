"""`ProcessEngine`: an engine that makes no collective (the embedded one) run in a process of its own, so its Python
and the trainer's never wait for one interpreter lock (`rl.engine_worker: process`).

The engine is built in a spawned child by `factory` (picklable, e.g. a `functools.partial` of a module function) with
`threads` torch threads; every call (`sync_weights`, `generate`, `run`) is sent over a pipe and waited for, in the
order made, so it is a plain synchronous engine: `BackgroundEngine` wraps it as it wraps the in-process one, its
worker thread waiting on the pipe (no interpreter lock held) while the child generates. Weights travel through
shared memory (torch's pickler for tensors); requests, settings and rollouts are plain data. So a generation is the
in-process engine's, token for token, given the same torch threads.

Failures: an error of the engine (a bad weight key) is raised by the call that made it, as a `RuntimeError` carrying
the child's traceback; a child that dies (killed, out of memory) is a `RuntimeError` naming its pid and exit code, and
every later call raises it too. The child exits when the parent closes it or its end of the pipe closes (the parent
died), so no engine process outlives its trainer.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.multiprocessing as mp

from veomni_lite.engines.base import Rollout, RolloutEngine, RolloutRequest, SamplingSettings

__all__ = ["ProcessEngine"]

T = TypeVar("T")
_CLOSE_TIMEOUT_S = 30.0


def _failure(exc: BaseException) -> str:
    """An error of the child as the parent raises it: the exception first, then its traceback."""
    summary = "".join(traceback.format_exception_only(exc)).strip()
    return f"{summary}\n(engine process traceback)\n{''.join(traceback.format_exception(exc))}"


def _serve(connection: Any, factory: Callable[[], RolloutEngine], threads: int) -> None:
    """The child: build the engine, then answer each call `(method, args)` with `(ok, value)` until told to stop."""
    torch.set_num_threads(threads)
    try:
        engine = factory()
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
        connection.send((False, _failure(exc)))
        return
    try:
        connection.send((True, engine.name))
        while (message := connection.recv()) is not None:
            method, args = message
            try:
                reply = (True, args[0]() if method == "run" else getattr(engine, method)(*args))
            except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it
                reply = (False, _failure(exc))
            connection.send(reply)
    except (EOFError, OSError):  # the parent is gone (its end of the pipe closed)
        pass
    finally:
        engine.close()


class ProcessEngine(RolloutEngine):
    """The engine `factory()` builds, in a child process with `threads` torch threads (module docstring)."""

    def __init__(self, factory: Callable[[], RolloutEngine], threads: int | None = None) -> None:
        context = mp.get_context("spawn")  # never fork a process holding threads and process groups
        self._connection, child = context.Pipe()
        threads = torch.get_num_threads() if threads is None else threads
        self._process = context.Process(target=_serve, args=(child, factory, threads), daemon=True)
        self._process.start()
        child.close()
        self._dead: str | None = None
        self.name = self._reply("start")

    def _reply(self, what: str) -> Any:
        """The child's answer to the call just sent (`what` names it in errors)."""
        try:
            ok, value = self._connection.recv()
        except (EOFError, OSError):
            self._process.join(5)
            self._dead = f"engine process (pid {self._process.pid}) exited with code {self._process.exitcode}"
            raise RuntimeError(f"{self._dead} during {what}") from None
        if not ok:
            raise RuntimeError(f"engine process: {what} failed: {value}")
        return value

    def _call(self, method: str, *args: Any) -> Any:
        if self._dead is not None:
            raise RuntimeError(f"{self._dead}; {method} not run")
        try:
            self._connection.send((method, args))
        except (BrokenPipeError, OSError):
            self._dead = f"engine process (pid {self._process.pid}) exited with code {self._process.exitcode}"
            raise RuntimeError(f"{self._dead}; {method} not run") from None
        return self._reply(method)

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._process.pid

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` run in the engine's process (picklable: e.g. pinning it to a core), its value returned."""
        return self._call("run", fn)

    def sync_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._call("sync_weights", dict(state_dict), version)
        self._version = version

    def generate(self, requests: Sequence[RolloutRequest], settings: SamplingSettings) -> list[list[Rollout]]:
        return self._call("generate", list(requests), settings)

    def close(self) -> None:
        """Stop the child (it closes its engine), killing it if it does not exit within 30 s."""
        if self._process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._connection.send(None)
            self._process.join(_CLOSE_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._connection.close()
