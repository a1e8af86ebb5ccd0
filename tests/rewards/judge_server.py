"""A scripted OpenAI-compatible chat endpoint for the judge's tests: a real HTTP server on 127.0.0.1 whose
answer to each request is a Python function of the request (the judge's behaviour is scripted; the client
under test is posttrain's own, over real sockets)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def completion(text: str, tokens: int = 7) -> tuple[int, bytes]:
    """A 200 answer holding the chat completion ``text``."""
    body = {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": tokens - 2, "completion_tokens": 2, "total_tokens": tokens},
    }
    return 200, json.dumps(body).encode()


def fenced_response(request: dict) -> str | None:
    """The response as a careful judge reads it: between the tags whose id the system message announces."""
    system = request["messages"][0]["content"]
    announced = re.search(r'<response id="([0-9a-f]+)">', system)
    user = request["messages"][-1]["content"]
    if announced is None:
        return None
    opener = f'<response id="{announced.group(1)}">\n'
    start = user.find(opener)
    end = user.rfind(f'\n</response id="{announced.group(1)}">')
    return user[start + len(opener) : end] if 0 <= start < end else None


def fenced_pair(request: dict) -> tuple[str, str] | None:
    """The two responses of a pairwise request (A, then B), each read between the tags whose id the system
    message announces for it."""
    system = request["messages"][0]["content"]
    user = request["messages"][-1]["content"]
    ids = re.findall(r'<response id="([0-9a-f]+)">', system)
    if len(ids) < 2:
        return None
    texts = []
    for tag_id in (ids[0], ids[-1]):
        opener, closer = f'<response id="{tag_id}">\n', f'\n</response id="{tag_id}">'
        start, end = user.find(opener), user.find(closer)
        if not 0 <= start < end:
            return None
        texts.append(user[start + len(opener) : end])
    return texts[0], texts[1]


class ScriptedJudge:
    """``answer(request) -> (status, body)`` served at ``base_url``/chat/completions; ``delay_s`` before each
    answer. Records the requests, their Authorization headers and the most requests in flight at once."""

    def __init__(self, answer: Callable[[dict], tuple[int, bytes]], delay_s: float = 0.0) -> None:
        self.answer = answer
        self.delay_s = delay_s
        self.requests: list[dict] = []
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server name)
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge._lock:
                    judge.requests.append(request)
                    judge.auth.append(self.headers.get("Authorization"))
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    time.sleep(judge.delay_s)
                    status, body = judge.answer(request)
                finally:
                    with judge._lock:
                        judge.in_flight -= 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client gave up (its timeout)
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self) -> ScriptedJudge:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
