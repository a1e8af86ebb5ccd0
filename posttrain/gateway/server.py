"""The gateway's HTTP server (:class:`Gateway`); the engine is fed by :class:`posttrain.gateway.batcher.Batcher`.

Endpoints (each also under ``/s/<session>/v1/...`` for a session opened with :meth:`Gateway.open_session`):
``POST /v1/chat/completions``, ``POST /v1/completions`` (session-less only), ``GET /v1/models``. Every request
needs ``Authorization: Bearer <api_key>`` (401 otherwise). Refusals are OpenAI-style JSON: 400 for anything a
retry cannot fix (bad fields, a closed session, a spent budget, a passed deadline, a too-long context, code
"context_length_exceeded"), 404 for an unknown path or session, 405 for a wrong method, 411/413 for a body
without a length / over ``max_request_bytes``; 500 when the engine raised (the message says so; it is logged and
the server keeps serving); 503 for calls still waiting when the gateway closes. The openai client retries 5xx.

Streaming (``stream: true``) answers with server-sent events built after generation has finished: a role chunk,
a content chunk (with the choice's ``token_ids``), a tool-calls chunk, the final chunk with the finish reason,
the usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``; tokens do not arrive one by one.

Batching: see :mod:`posttrain.gateway.batcher` (one engine thread calls the backend).

In a session, sampling is the run's (the session's ``params``); request temperature/top_p/top_k that differ are
recorded in ``CallRecord.overridden`` (and counted), the request's ``seed`` is ignored. The session-less endpoint
(``base_url``, for serving) honours the request's temperature (0: greedy), top_p, top_k and max_tokens, defaults
from ``default_params``; a request ``seed`` makes its sample reproducible (sample id 0 under that seed); without one
each call gets a fresh sample id. Nothing is recorded for it but counts.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import json
import logging
import re
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from posttrain.agents.render import Renderer
from posttrain.gateway import protocol as P
from posttrain.gateway import responses as R
from posttrain.gateway.batcher import Backend, Batcher
from posttrain.gateway.capture import CallRecord, Session, template_errors
from posttrain.gateway.prompt_scores import PromptScores
from posttrain.rollout.base import SamplingParams, TurnRequest

logger = logging.getLogger("posttrain.gateway")
_CLOSE_WAIT_S = 30.0  # at close, how long answers being written are waited for
_LINGER_S = 1.0  # how long a refused client's unread body is read before the connection closes
_PATH = re.compile(r"(?:/s/([A-Za-z0-9_-]+))?/v1/(chat/completions|completions|models)/?")


@dataclass(frozen=True)
class SessionHandle:
    """What a harness needs for one trajectory: its base URL and the key."""

    id: str
    base_url: str
    api_key: str


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close joins the handler threads
    block_on_close = True
    request_queue_size = 256  # many harnesses connect at once

    def __init__(self, address: tuple[str, int], gateway: Gateway) -> None:
        self.gateway = gateway
        self.connections: set[socket.socket] = set()
        self.idle: set[socket.socket] = set()  # connections waiting for their next request
        self.closing = False
        self.conn_lock = threading.Lock()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.exception("gateway: error on a connection from %s", client_address)


class Gateway:
    """An OpenAI-compatible endpoint over a rollout engine, recording each session's calls exactly.

    A context manager: entering starts serving in background threads, leaving stops them (:meth:`close`).
    """

    def __init__(
        self,
        backend: Backend,
        tokenizer: Any,
        *,
        model_name: str = "policy",
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_request_bytes: int = 4 << 20,
        max_model_len: int | None = None,
        default_params: SamplingParams | None = None,
        prompt_scorer: Callable[[list[int], float, int], PromptScores] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key or secrets.token_urlsafe(24)
        self.max_request_bytes = max_request_bytes
        self.max_model_len = max_model_len
        self.default_params = default_params or SamplingParams(max_tokens=256)
        self.prompt_scorer = prompt_scorer  # echo=true completions; None: refused (400)
        self.batcher = Batcher(backend)
        self._server = _Server((host, port), self)
        bound_host, bound_port = self._server.server_address[:2]
        self.root_url = f"http://{bound_host}:{bound_port}"
        self.base_url = f"{self.root_url}/v1"
        self._sessions: dict[str, Session] = {}
        self._closed_sessions: set[str] = set()
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._sample_ids = itertools.count()
        self.created = int(time.time())
        self._serve_thread: threading.Thread | None = None

    def __enter__(self) -> Gateway:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Serve in background threads (the HTTP loop and the engine thread)."""
        self.batcher.start()
        self._serve_thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="gateway-http", daemon=True
        )
        self._serve_thread.start()

    def close(self) -> None:
        """Stop serving: calls still waiting get 503, open connections are closed, every thread is joined."""
        if self._serve_thread is not None:
            self._server.shutdown()
            self._serve_thread.join()
            self._serve_thread = None
        self._server.closing = True  # handlers answering now close their connection after the answer
        self.batcher.close()
        end = time.monotonic() + _CLOSE_WAIT_S
        while True:  # wake handlers idling on keep-alive connections; let the others write their answer
            with self._server.conn_lock:
                left = set(self._server.connections)
                idle = left & self._server.idle if time.monotonic() < end else left
            if not left:
                break
            for conn in idle:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            time.sleep(0.01)
        self._server.server_close()

    # ------------------------------------------------------------------ sessions
    def open_session(
        self,
        *,
        sample_id: int,
        params: SamplingParams,
        max_response_tokens: int,
        max_tokens_per_turn: int = 0,
        deadline: float | None = None,
        render_tools: bool = True,
    ) -> SessionHandle:
        """A session for one trajectory (see ``posttrain.gateway.capture``); ``deadline``: a ``time.monotonic()``
        after which its calls are refused; ``render_tools=False``: the requests' tool schemas are not rendered
        into the prompt (their calls are still parsed)."""
        for name, value, low in (
            ("max_response_tokens", max_response_tokens, 1),
            ("max_tokens_per_turn", max_tokens_per_turn, 0),
            ("sample_id", sample_id, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"open_session: {name}={value!r} must be an integer >= {low}")
        sid = secrets.token_hex(8)
        session = Session(
            sid,
            sample_id=sample_id,
            params=params,
            max_response_tokens=max_response_tokens,
            max_tokens_per_turn=max_tokens_per_turn,
            deadline=deadline,
            render_tools=render_tools,
        )
        with self._lock:
            self._sessions[sid] = session
        return SessionHandle(sid, f"{self.root_url}/s/{sid}/v1", self.api_key)

    def close_session(self, session_id: str) -> list[CallRecord]:
        """The session's records, in call order; its later calls are refused (400). Waits for a call in flight."""
        with self._lock:
            session = self._sessions.pop(session_id)
            self._closed_sessions.add(session_id)
        with session.lock:
            session.closed = True
            return list(session.records)

    def metrics(self) -> dict[str, float]:
        """Counters since start: gateway/requests, errors, overridden_params, prefix_breaks, ignored_fields,
        sessionless_calls, backend_calls, open_sessions."""
        with self._lock:
            out = {f"gateway/{k}": float(v) for k, v in self._counts.items()}
            out["gateway/open_sessions"] = float(len(self._sessions))
        out["gateway/backend_calls"] = float(self.batcher.calls)
        for key in ("requests", "errors", "overridden_params", "prefix_breaks", "ignored_fields"):
            out.setdefault(f"gateway/{key}", 0.0)
        return out

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def session(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            closed = session_id in self._closed_sessions
        if session is None:
            if closed:
                raise P.bad(
                    "session", f"session {session_id} is closed; open a new one", code="session_closed"
                )
            raise P.ProtocolError(404, f"no session {session_id!r} on this gateway", code="session_not_found")
        return session

    # ------------------------------------------------------------------ requests
    def chat(self, session_id: str | None, req: P.ChatRequest) -> R.Completion:
        """Serve one chat request (the handler writes the answer); raises ProtocolError."""
        self.count("ignored_fields", len(req.ignored))
        if session_id is None:
            with template_errors():
                ids = Renderer(self.tokenizer, tools=req.tools).prompt_ids(req.template_messages)
            return self._finish(req, ids, self._sessionless(req, ids), req.tool_names, req.tool_choice)[0]
        session = self.session(session_id)
        if req.sampling.seed is not None:
            self.count("ignored_fields")
        with session.lock:
            with template_errors():
                plan = session.plan(req, self.tokenizer, self.max_model_len)
            turn = TurnRequest(
                ids=plan.prompt_ids,
                max_tokens=plan.max_tokens,
                sample_id=session.sample_id,
                position=plan.noise_position,
                session=session.sample_id,
            )
            completion, record = self._finish(
                req, plan.prompt_ids, (turn, session.params), req.tool_names, req.tool_choice
            )
            record.extends_previous, record.overridden = plan.extends_previous, plan.overridden
            record.messages = req.messages
            breaks = session.prefix_breaks
            session.record(req, plan, record, P.returned_message(completion.content, completion.tool_calls))
            self.count("prefix_breaks", session.prefix_breaks - breaks)
            self.count("overridden_params", len(plan.overridden))
        return completion

    def complete(self, req: P.CompletionRequest) -> R.Completion:
        """Serve one (legacy) completion request, session-less."""
        self.count("ignored_fields", len(req.ignored))
        prompt = req.prompt
        ids = list(self.tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else list(prompt)
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in ids):
            raise P.bad("prompt", f"holds token ids >= the vocabulary size {vocab}")
        if req.echo:
            return self._score_prompt(req, ids)
        completion, _ = self._finish(req, ids, self._sessionless(req, ids), [], "none")
        completion.content = None
        return completion

    def _score_prompt(self, req: P.CompletionRequest, ids: list[int]) -> R.Completion:
        """echo=true, max_tokens=0: the prompt's log-probs at the request's temperature (0 or unset: 1, the
        model's own distribution), nothing generated."""
        if self.prompt_scorer is None:
            raise P.bad(
                "echo", "this server does not score prompts (it needs the native engine); send echo=false"
            )
        self._check_context(ids, "prompt")
        temperature = req.sampling.temperature or 1.0
        scores = self.prompt_scorer(ids, temperature, req.logprobs_count or 0)
        self.count("scored_prompts")
        decode = self.tokenizer.decode
        tops = [None if t is None else {decode([i]): lp for i, lp in t.items()} for t in scores.top]
        text = decode(ids)
        return R.Completion(
            self.model_name, ids, ids, scores.logprobs, text, "length", None, top_logprobs=tops
        )

    def _sessionless(self, req: Any, ids: list[int]) -> tuple[TurnRequest, SamplingParams]:
        s, d = req.sampling, self.default_params
        self._check_context(ids, "prompt" if isinstance(req, P.CompletionRequest) else "messages")
        limit = s.max_tokens or d.max_tokens
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - len(ids))
        temperature = d.temperature if s.temperature is None else s.temperature
        params = SamplingParams(
            max_tokens=limit,
            temperature=temperature or 1.0,
            greedy=temperature == 0 or (s.temperature is None and d.greedy),
            top_p=d.top_p if s.top_p is None else s.top_p,
            top_k=d.top_k if s.top_k is None else s.top_k,
            seed=d.seed if s.seed is None else abs(s.seed),
        )
        sample_id = 0 if s.seed is not None else next(self._sample_ids)
        self.count("sessionless_calls")
        return TurnRequest(ids=ids, max_tokens=limit, sample_id=sample_id), params

    def _check_context(self, ids: list[int], param: str = "messages") -> None:
        if self.max_model_len is not None and len(ids) >= self.max_model_len:
            raise P.bad(
                param,
                f"the prompt is {len(ids)} tokens; the model's context is {self.max_model_len} tokens",
                code="context_length_exceeded",
            )

    def _finish(
        self,
        req: Any,
        prompt_ids: list[int],
        turn: tuple[TurnRequest, SamplingParams],
        names: list[str],
        tool_choice: Any,
    ) -> tuple[R.Completion, CallRecord]:
        request, params = turn
        gen = self.batcher.submit(request, params)
        ids, logprobs = list(gen.ids[: request.max_tokens]), list(gen.logprobs[: request.max_tokens])
        ids, text, hit = R.apply_stop(self.tokenizer, ids, req.sampling.stop)
        logprobs = logprobs[: len(ids)]
        reason = "stop" if hit else gen.finish_reason
        content, calls = R.split_tool_calls(text, names, tool_choice)
        finish = "tool_calls" if calls else ("length" if reason == "length" else "stop")
        completion = R.Completion(self.model_name, prompt_ids, ids, logprobs, text, finish, content, calls)
        record = CallRecord(prompt_ids, ids, logprobs, reason, False, [], text, tool_calls=len(calls))
        return completion, record


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = 300  # an idle keep-alive connection is closed after this long
    # Headers and body leave in two writes: with Nagle's algorithm the body waited for the client's delayed ACK
    # of the headers, up to 40 ms a call (docs/results/gateway.md measured p50 48 ms with it, 4.8 ms without).
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        with self.server.conn_lock:
            self.server.connections.add(self.connection)

    def finish(self) -> None:
        with self.server.conn_lock:
            self.server.connections.discard(self.connection)
            self.server.idle.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def handle_one_request(self) -> None:
        with self.server.conn_lock:
            self.server.idle.add(self.connection)
        super().handle_one_request()
        if self.server.closing:
            self.close_connection = True

    def parse_request(self) -> bool:
        with self.server.conn_lock:  # a request line arrived: busy until answered
            self.server.idle.discard(self.connection)
        return super().parse_request()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        logger.debug(format, *args)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (malformed request line, unsupported method) as OpenAI JSON."""
        self._error(P.ProtocolError(code, message or self.responses.get(code, ("error",))[0]))

    def _send(self, code: int, data: bytes, content_type: str = "application/json") -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            if code >= 400:
                self.send_header("Connection", "close")
                self.close_connection = True
            if code == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away
            self.close_connection = True

    def _error(self, err: P.ProtocolError) -> None:
        self.server.gateway.count("errors")
        self._send(err.status, json.dumps(P.error_body(err)).encode())
        self._drain()

    def _drain(self) -> None:
        """Read what the client still sends (an unread body) before closing: closing on unread data resets
        the connection, and the client could lose our answer."""
        with contextlib.suppress(OSError):
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            left = 1 << 20
            while left > 0 and (data := self.connection.recv(65536)):
                left -= len(data)

    def _route(self, method: str) -> tuple[str | None, str] | None:
        """(session id, endpoint) after checking the key, the path and the method; None once answered."""
        gw = self.server.gateway
        gw.count("requests")
        sent = str(self.headers.get("Authorization", "")).encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(sent, f"Bearer {gw.api_key}".encode()):
            self._error(
                P.ProtocolError(
                    401,
                    "send the header `Authorization: Bearer <api key>` with this gateway's key",
                    code="invalid_api_key",
                )
            )
            return None
        match = _PATH.fullmatch(self.path.split("?", 1)[0])
        if match is None:
            self._error(P.ProtocolError(404, f"no such path {self.path}"))
            return None
        endpoint = match.group(2)
        if (endpoint == "models") != (method == "GET"):
            self._error(P.ProtocolError(405, f"{method} is not allowed on {self.path}"))
            return None
        return match.group(1), endpoint

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        route = self._route("GET")
        if route is not None:
            gw = self.server.gateway
            try:
                if route[0] is not None:
                    gw.session(route[0])
            except P.ProtocolError as err:
                self._error(err)
                return
            self._send(200, json.dumps(R.models_response(gw.model_name, gw.created)).encode())

    def do_POST(self) -> None:  # noqa: N802
        route = self._route("POST")
        if route is None:
            return
        try:
            body = self._body()
            self._answer(route[0], route[1], body)
        except P.ProtocolError as err:
            self._error(err)
        except Exception:  # a bug here: answered, logged, the server keeps serving
            logger.exception("gateway: error answering %s", self.path)
            self._error(P.ProtocolError(500, "internal error of the gateway (logged on the server)"))

    def _answer(self, session_id: str | None, endpoint: str, body: Any) -> None:
        gw = self.server.gateway
        if endpoint == "completions":
            if session_id is not None:
                raise P.bad("path", "a session serves chat completions only; use /v1/completions without one")
            req = P.parse_completion(body)
            c = gw.complete(req)
            if req.sampling.stream:
                self._send(200, R.sse(R.completion_chunks(c, gw.tokenizer, req)), "text/event-stream")
            else:
                payload = R.completion_response(c, gw.tokenizer, req.logprobs_count)
                self._send(200, json.dumps(payload).encode())
            return
        chat = P.parse_chat(body)
        c, sampling = gw.chat(session_id, chat), chat.sampling
        if sampling.stream:
            self._send(200, R.sse(R.chat_chunks(c, gw.tokenizer, sampling)), "text/event-stream")
        else:
            self._send(200, json.dumps(R.chat_response(c, gw.tokenizer, sampling)).encode())

    def _body(self) -> Any:
        gw = self.server.gateway
        if self.headers.get("Transfer-Encoding"):
            raise P.ProtocolError(411, "send the body with a Content-Length header (no chunked encoding)")
        raw = self.headers.get("Content-Length")
        if raw is None or not raw.strip().isdigit():
            raise P.ProtocolError(411, f"a POST needs a valid Content-Length header, got {raw!r}")
        length = int(raw)
        if length > gw.max_request_bytes:
            raise P.ProtocolError(413, f"body of {length} bytes; at most {gw.max_request_bytes}")
        data = self.rfile.read(length)
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise P.bad("body", f"is not valid JSON ({exc})") from None

    def _method_not_allowed(self) -> None:
        if self._route(self.command) is not None:  # a known path: the method is the problem
            self._error(P.ProtocolError(405, f"{self.command} is not allowed on {self.path}"))

    do_PUT = do_DELETE = do_PATCH = _method_not_allowed  # noqa: N815
