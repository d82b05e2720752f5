"""A launched vLLM server (`VLLMServer`, `launch: N`): `python -m vllm.entrypoints.openai.api_server` with the
interpreter `rl.vllm.python`, from the run's `model.pretrained_dir`, on 127.0.0.1 and a free port, in dev mode, in a
session of its own. Its whole process group ends at `stop` (the engine's `close`), when it does not answer /health
within `start_timeout_s`, at interpreter exit, when the trainer process dies, and when the server itself ends
(`boot`: its first process, with a watchdog in the group). For a text model a server never tokenizes
(`--skip-tokenizer-init`: ids in, ids out); for a vision-language model it renders prompts itself
(`--trust-request-chat-template`). It ignores the model directory's generation config and reports processed
log-probabilities (docs/vllm.md).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import torch

from veomni_lite.engines.vllm.boot import end_group, members
from veomni_lite.engines.vllm.settings import NAME, EngineError

logger = logging.getLogger(__name__)

BOOT = Path(__file__).with_name("boot.py")
"""A launched server's first process (`boot.py`), run as a file by the server's interpreter."""
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Variables torchrun sets for the trainer's ranks, which vLLM's own process setup must not read as its own.
_TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
)  # fmt: skip


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shared_memory(pids: Sequence[int]) -> dict[str, int]:
    """The files in /dev/shm of Python's multiprocessing that the processes `pids` map, with their inodes: shared
    memory segments (psm_*; a launched server's: vLLM's message queues) and named semaphores (sem.mp-*, mapped under
    a temporary name, so found by inode)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    inodes.add(int(fields[4]))
    found = {}
    with contextlib.suppress(OSError), os.scandir("/dev/shm") as entries:
        for entry in entries:
            if entry.name.startswith(("psm_", "sem.mp-")) and entry.inode() in inodes:
                found[entry.path] = entry.inode()
    return found


def cpu_server_args(server_args: Sequence[str]) -> list[str]:
    """What a server on this machine's CPUs needs (none where CUDA is there): vLLM 0.32's CPU build kills its engine
    ("CPU Generator does not use offset") when a seeded request's prompt is prefilled in chunks, which a wave of
    requests longer than its token budget causes, so chunked prefill is off unless `server_args` say otherwise."""
    if torch.cuda.is_available() or any("chunked-prefill" in arg for arg in server_args):
        return []
    return ["--no-enable-chunked-prefill"]


class VLLMServer:
    """A vLLM OpenAI-compatible server this process starts on 127.0.0.1 (see the module docstring) and stops, with
    every process it starts: they share a process group of their own (`boot`), whose id is `pid`. Build it on a
    thread that lives as long as the server: Linux's parent-death signal, which ends the server with the trainer,
    follows the creating thread."""

    MODULE = SERVER_MODULE
    """What the server process runs (`python -m MODULE`); tests put a stand-in here."""

    def __init__(
        self,
        python: str,
        model_dir: str,
        log_path: str | Path,
        server_args: Sequence[str] = (),
        port: int = 0,
        renders_prompts: bool = False,
        api_key: str = "",
    ) -> None:
        """`renders_prompts`: the server loads the tokenizer and processor and trusts a request's chat template (VL).
        `api_key`: the key the server requires on its /v1 routes (vLLM's `--api-key`, passed as `VLLM_API_KEY` so it
        is not on a command line other users can read); "": none."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.api_key = api_key
        self._code: int | None = None
        self._stopped = False
        self._shm: dict[str, int] = {}  # the shared memory its group mapped, by inode (`stop` unlinks what is left)
        args = [
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
            "--trust-request-chat-template" if renders_prompts else "--skip-tokenizer-init", "--generation-config",
            "vllm", "--logprobs-mode", "processed_logprobs", "--seed", "0", *cpu_server_args(server_args), *server_args,
        ]  # fmt: skip
        env = {key: value for key, value in os.environ.items() if key not in _TORCHRUN_ENV}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc and /reset_prefix_cache; never reachable off loopback
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU build (ignored on GPU)
        env.pop("VLLM_API_KEY", None)  # the key is the run's (rl.vllm.api_key_env) or none
        if api_key:
            env["VLLM_API_KEY"] = api_key
        if not Path(python).is_file():
            raise EngineError(f"{NAME}: rl.vllm.python {python!r} does not exist (make vllm-env builds .venv-vllm)")
        boot = [python, "-I", str(BOOT), str(os.getpid()), self.MODULE, *args]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                boot, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        self.pid = self.process.pid  # also the process group's id (a session of its own)
        self.started = time.monotonic()
        atexit.register(self.stop)
        logger.info("%s: started pid %d on %s (log %s)", NAME, self.pid, self.url, self.log_path)

    def exited(self, wait_s: float = 0.0) -> int | None:
        """The server's exit code (-N: killed by signal N), or None while it runs, waiting up to `wait_s` seconds for
        it to end. The server is not reaped before `stop`, so its pid keeps naming its process group."""
        deadline = time.monotonic() + wait_s
        while self._code is None:
            self._code = self._status()
            if self._code is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return self._code

    def _status(self) -> int | None:
        """The exit code if the server has exited, seen without reaping it (waitid WNOWAIT)."""
        if not hasattr(os, "waitid"):  # pragma: no cover - no waitid (macOS): poll, which reaps
            return self.process.poll()
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already
            return self.process.poll()
        if info is None:
            return None
        return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float, started: float) -> None:
        """Until GET /health answers 200; EngineError (server stopped) when it exits or `timeout_s` after
        `started` (a `time.monotonic()`) passes."""
        while not self.ready_now(timeout_s, started):
            time.sleep(0.5)

    def ready_now(self, timeout_s: float, started: float) -> bool:
        """One look: whether GET /health answers 200 now; EngineError (server stopped) when the server has exited or
        `timeout_s` after `started` (a `time.monotonic()`) has passed."""
        code = self.exited()
        if code is not None:
            self.stop()
            raise EngineError(
                f"{NAME} (launched, pid {self.pid}) exited with code {code} before it was ready; the end of its "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(urllib.request.Request(self.url + "/health", headers=headers), timeout=5) as answer,
        ):
            if answer.status == 200:
                self._shm |= shared_memory(members(self.pid))  # vLLM's queues and semaphores, made at its start
                return True
        if time.monotonic() - started > timeout_s:
            self.stop()
            raise EngineError(
                f"{NAME} (launched, pid {self.pid}) did not answer GET {self.url}/health within "
                f"rl.vllm.start_timeout_s = {timeout_s:g} s; stopped it. The end of its log {self.log_path}:\n"
                f"{self.log_tail()}"
            )
        return False

    def terminate(self) -> None:
        """Ask the server's whole process group to shut down (SIGTERM), without waiting; `stop` finishes."""
        if not self._stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGTERM)

    def stop(self) -> None:
        """End the server's whole process group (`boot.end_group`: SIGTERM, up to 10 s, SIGKILL), whether the
        server runs or has exited, then reap it, and unlink the shared memory its group mapped that is left
        (idempotent)."""
        if self._stopped:
            return
        self._shm |= shared_memory(members(self.pid))
        end_group(self.pid)  # the server is not reaped yet: its pid still names its group
        for path, inode in self._shm.items():  # left when the group was killed before vLLM or its resource tracker
            with contextlib.suppress(OSError):  # unlinked them; the inode: still that file, not a new one of the name
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        self._code = self.process.returncode if self._code is None else self._code
        self._stopped = True
        atexit.unregister(self.stop)
