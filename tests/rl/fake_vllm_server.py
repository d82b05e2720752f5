"""A stand-in for `python -m vllm.entrypoints.openai.api_server` where vLLM is absent (`VLLMServer.MODULE` in
tests/rl/test_vllm.py): like vLLM, it starts an "engine core" child process (same process group), which outlives it
when it is killed, and answers GET /health and /v1/models on --host/--port. On SIGTERM it stops its child and exits, as
vLLM shuts down."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        data = json.dumps({"data": [{"id": "fake"}]} if self.path == "/v1/models" else {}).encode()
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

    def shut_down(*_: Any) -> None:
        core.terminate()
        core.wait()
        sys.exit(0)

    signal.signal(signal.SIGTERM, shut_down)
    print(f"fake vLLM server: engine core pid {core.pid}", flush=True)
    ThreadingHTTPServer((args.host, args.port), _Handler).serve_forever()


if __name__ == "__main__":
    main()
