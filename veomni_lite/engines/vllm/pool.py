"""Which of rank 0's servers serve (`Pool`): a server that is gone (`client.ServerDown`: its connection refused, reset
or closed, or a launched server exited) stops getting requests; a launched one is stopped with its whole process group
and relaunched from `model.pretrained_dir`, up to `rl.vllm.max_restarts` times over the run (all servers together);
the relaunched server, and a user's server that answers again, join before a later wave or sync (the engine brings
them to the current weights and checks them). The run ends with a named `EngineError` only when no server serves and
none can join: every user's server down and every launched one gone (its relaunches used up).

Rank 0 alone decides, inside the engine's calls that the other ranks wait on, so which server is dead never changes
which collectives a rank makes. A relaunched server is built on a thread of the pool's that lives until `close`:
Linux's parent-death signal, which ends a launched server with the trainer, follows the creating thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from veomni_lite.engines.vllm.check import SyncCheck
from veomni_lite.engines.vllm.client import Client, Endpoint, ServerDown
from veomni_lite.engines.vllm.server import VLLMServer
from veomni_lite.engines.vllm.settings import NAME, EngineError, VLLMSettings

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 5.0
"""How long a user's server that stopped answering gets to answer GET /v1/models when it is tried again."""


class Pool:
    """Rank 0's servers (`slots`, one `Endpoint` each, replaced by a relaunch) and their states (see the module
    docstring). `launch(log_path)`: a new launched server logging to `log_path`."""

    def __init__(
        self, settings: VLLMSettings, endpoints: Sequence[Endpoint], launch: Callable[[Path], VLLMServer]
    ) -> None:
        self.settings = settings
        self.slots = list(endpoints)
        self.launch = launch
        self.restarts = 0
        """Relaunches so far."""
        self.last_cause: EngineError | None = None
        self._lock = threading.Lock()
        self._launcher: ThreadPoolExecutor | None = None
        self._closed = False

    def serving(self) -> list[Endpoint]:
        return [endpoint for endpoint in self.slots if endpoint.state == "serving"]

    def down(self, endpoint: Endpoint, cause: EngineError) -> None:
        """`endpoint` is gone (thread-safe; a second report of the same server, or of a server since replaced, is
        ignored): a launched one is stopped with its process group and, while relaunches are left, relaunched."""
        with self._lock:
            if endpoint not in self.slots or endpoint.state == "gone":
                return
            if endpoint.state == "joining" and endpoint.server is None:
                return  # a user's server tried again: still down
            relaunch = endpoint.server is not None and not self._closed
            relaunch = relaunch and self.restarts < self.settings.max_restarts
            if relaunch:
                self.restarts += 1
            endpoint.state = "joining" if endpoint.server is None else "gone"
            self.last_cause = cause
        logger.warning("%s at %s is down (%s)", NAME, endpoint.url, cause)
        if endpoint.server is None:
            return
        endpoint.server.stop()  # whatever is left of its process group
        if not relaunch:
            logger.warning("%s at %s: not relaunched (rl.vllm.max_restarts = %d used)", NAME, endpoint.url,
                           self.settings.max_restarts)  # fmt: skip
            return
        if self._launcher is None:
            self._launcher = ThreadPoolExecutor(1, "vllm-launcher")
        self._launcher.submit(self._relaunch, endpoint).result()

    def _relaunch(self, old: Endpoint) -> None:
        """On the launcher thread: `old`'s slot gets a new server, joining."""
        assert old.server is not None
        server = self.launch(old.server.log_path)
        fresh = Endpoint(server.url, server, SyncCheck(self.settings.probe_tolerance), state="joining")
        with self._lock:
            self.slots[self.slots.index(old)] = fresh
        logger.warning("%s: relaunched the server of %s as pid %d on %s (relaunch %d of rl.vllm.max_restarts = %d)",
                       NAME, old.url, server.pid, server.url, self.restarts, self.settings.max_restarts)  # fmt: skip

    def joiners(self, client: Client, wait: bool) -> list[Endpoint]:
        """The joining servers that answer now, their model names known (the caller brings them up to date and
        `admit`s them); a launched one that exited or did not start within `start_timeout_s` is down again. `wait`:
        when no server serves, wait for a launched one to answer. EngineError when no server serves and none can
        join."""
        while True:
            ready = []
            for endpoint in [e for e in self.slots if e.state == "joining"]:
                try:
                    if endpoint.server is not None and not endpoint.server.ready_now(
                        self.settings.start_timeout_s, endpoint.server.started
                    ):
                        continue
                    timeout_s = None if endpoint.server is not None else JOIN_TIMEOUT_S
                    client.model_name(endpoint, timeout_s)
                    ready.append(endpoint)
                except EngineError as exc:
                    self.down(endpoint, exc if isinstance(exc, ServerDown) else ServerDown(str(exc)))
            starting = [e for e in self.slots if e.state == "joining" and e.server is not None]
            if ready or self.serving() or not wait:
                return ready
            if not starting:
                raise EngineError(self._none_left())
            time.sleep(0.5)

    def admit(self, endpoint: Endpoint) -> None:
        endpoint.state = "serving"
        logger.warning("%s at %s serves again", NAME, endpoint.url)

    def _none_left(self) -> str:
        launched = any(endpoint.server is not None for endpoint in self.slots)
        used = f"; relaunches used: {self.restarts} of rl.vllm.max_restarts = {self.settings.max_restarts}"
        return (
            f"{NAME}: no server left of {len(self.slots)}{used if launched else ''}; the last failure: "
            f"{self.last_cause}"
        )

    def close(self) -> None:
        """No more relaunches; a relaunch under way finishes first, so the caller then stops every server."""
        with self._lock:
            self._closed = True
        if self._launcher is not None:
            self._launcher.shutdown(wait=True)
