"""A stand-in for `python -m vllm.entrypoints.openai.api_server` where vLLM is absent (`VLLMServer.MODULE` in
tests/rl/test_vllm.py): like vLLM, it starts an "engine core" child process (same process group), which outlives it
when it is killed, and answers GET /health and /v1/models on --host/--port, and POSTs as `answer` does (printing each
to its log: its pid, the route and a sample's seed). It maps a shared memory segment, which it unlinks on SIGTERM
before it stops its child and exits, as vLLM shuts down; killed, it leaves the segment in /dev/shm."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing import resource_tracker, shared_memory
from typing import Any


def fake_logprobs(ids: list[int]) -> list[float]:
    """The fake's log-probabilities of ids[1:] (its probe answer), a function of the ids alone."""
    return [-0.5 - 0.01 * t for t in ids[1:]]


def answer(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the fake answers a POST of `body` to `route`: a completion's sample is a function of its prompt and seed
    alone, a probe's prompt log-probabilities `fake_logprobs`; the weight routes answer {}."""
    if route != "/v1/completions":
        return {}
    prompt = body["prompt"]
    if body.get("prompt_logprobs") is not None:
        entries = [None] + [{str(t): {"logprob": v}} for t, v in zip(prompt[1:], fake_logprobs(prompt))]
        return {"choices": [{"prompt_logprobs": entries}]}
    ids = [3 + (sum(prompt) * 31 + body["seed"] * 17 + k) % 90 for k in range(body["max_tokens"])]
    return {
        "choices": [{"token_ids": ids, "finish_reason": "length", "logprobs": {"token_logprobs": [-0.25] * len(ids)}}]
    }


_PRINT = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._send({"data": [{"id": "fake"}]} if self.path == "/v1/models" else {})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        with _PRINT:  # one whole line per request
            print(os.getpid(), self.path, body.get("seed", ""), flush=True)
        self._send(answer(self.path, body))

    def _send(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    core = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    time.sleep(1)"])
    # like vLLM's message queues: unlinked at a shutdown, left in /dev/shm when the process is killed (untracked)
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]

    def shut_down(*_: Any) -> None:
        segment.close()
        segment.unlink()
        core.terminate()
        core.wait()
        sys.exit(0)

    signal.signal(signal.SIGTERM, shut_down)
    print(f"fake vLLM server: engine core pid {core.pid}, shared memory /dev/shm{segment._name}", flush=True)
    ThreadingHTTPServer((args.host, args.port), _Handler).serve_forever()


if __name__ == "__main__":
    main()
