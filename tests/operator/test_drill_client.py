"""The switch drill's and soak's client leaves no connection open after an answer.

Defect prevented: ``benchmarks.switch_drill.ask`` made an ``openai.OpenAI`` client per request
and never closed it, so each answer left its keep-alive connection open until the garbage
collector reached the client. The one-hour soak counted those idle connections as the
router's descriptors (35 -> 43, median of the first against the last fifth) and failed its
``fds_flat`` check on a router that leaked nothing.

The server here is a stand-in for the router (an HTTP/1.1 server on loopback that answers
every chat completion with a canned one): what is under test is only the client's
connection hygiene, which needs a server that counts its open connections, not an engine.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.switch_drill import ask

COMPLETION = {
    "id": "c",
    "object": "chat.completion",
    "created": 0,
    "model": "tiny-llava",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "length"}
    ],
}
CHUNK = {**COMPLETION, "object": "chat.completion.chunk"}
CHUNK["choices"] = [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]


class CountingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.open = 0
        self.lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the router's server does
    server: CountingServer

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.open += 1

    def finish(self) -> None:
        super().finish()
        with self.server.lock:
            self.server.open -= 1

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("stream"):
            data = f"data: {json.dumps(CHUNK)}\n\ndata: [DONE]\n\n".encode()
            kind = "text/event-stream"
        else:
            data, kind = json.dumps(COMPLETION).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[CountingServer]:
    srv = CountingServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def open_after(server: CountingServer, timeout_s: float = 5.0) -> int:
    """Connections still open once the server had ``timeout_s`` to see closed ones end."""
    deadline = time.monotonic() + timeout_s
    while server.open and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.open


def test_every_answer_closes_its_connection(server: CountingServer) -> None:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    gc.disable()  # the defect hid behind the collector: without it, nothing else closes them
    try:
        for i in range(6):
            answer = ask(url, [{"role": "user", "content": "hello"}], stream=i % 2 == 0)
            assert answer.error == "" and answer.text == "hi"
        assert open_after(server) == 0
    finally:
        gc.enable()
