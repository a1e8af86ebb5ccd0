"""The gateway's cost: its overhead per call, and calculator trajectories per second through it vs the native loop.

Run (one torch thread): ``OMP_NUM_THREADS=1 python3 benchmarks/gateway_overhead.py`` (a few minutes on 2 CPU
cores; ``--quick`` for a smaller run; ``--help`` for the sizes). Needs the ``openai`` package.

Part 1, overhead per call. ``--sessions`` (1, 16, 64) sessions at once, each a client on its own thread making
``--calls-per-session`` chat calls in a row (each call appends the returned assistant message and a short user
message: the capture's incremental path); sessions are reopened until ``--calls`` calls are timed. Overhead of a
call = the latency the client saw - the time the backend spent in the engine call that served it (the backend is
wrapped and timed; a call batched with others is charged its whole engine call). Backends: "null" returns
``--null-tokens`` fixed ids at once (what is left is the gateway's own cost: HTTP, JSON, rendering, capture, the
batcher's gathering window of 2 ms), "native" is the native engine over the tiny model (the overhead's share of a
real call). Clients: the real ``openai`` client (its own cost is part of what a user pays) and bare
``http.client`` (the gateway alone). Clients and server share this process (as a Python-callable harness does),
so with many sessions the figures include the clients' CPU time and the wait for a core.

Part 2, calculator trajectories per second: ``--trajectories`` trajectories at once, the ``calculator`` task's
environment with its tool schemas in the prompt (``rollout.multi_turn.render_tools=true``), the same seed and token budgets, via
- native: ``posttrain.agents.driver.run_trajectories`` over the engine,
- gateway: an async ``openai`` client per trajectory doing the same loop (chat -> tool call -> tool message ->
  chat) against its session of a :class:`~posttrain.gateway.server.Gateway` over the same engine; the session's
  calls are assembled into a trajectory (``posttrain.gateway.assemble``), as the harness loop does.
The random tiny model never writes a tool call, so both paths share a backend that replaces each trajectory's
first turn with a fixed calculator call: the engine still samples as many tokens as the call has (its compute is
paid), then the call's ids are returned. The second turn is the model's own text (no call: the episode ends).
Runs alternate native / gateway from an empty engine cache (``release_memory``); medians of ``--repeats`` each
after one untimed warm-up of each. The tiny model makes the engine's share small, so the ratio is pessimistic
for the gateway: with a real model the same fixed cost is a smaller part of a call.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import http.client
import itertools
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai  # noqa: E402
from rollout_backends import cpu_name  # noqa: E402

from posttrain.agents.builtin_envs import CalculatorEnv, calculator  # noqa: E402
from posttrain.agents.driver import Generation, MultiTurnSettings, engine_generate, run_trajectories  # noqa: E402
from posttrain.config.schema.agents import MultiTurnConfig  # noqa: E402
from posttrain.gateway import server as server_module  # noqa: E402
from posttrain.gateway.assemble import assemble  # noqa: E402
from posttrain.gateway.server import Gateway  # noqa: E402
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from posttrain.rollout.base import SamplingParams, TurnRequest  # noqa: E402
from posttrain.rollout.native.engine import NativeEngine  # noqa: E402

NULL_TEXT = " The quick brown fox jumps over the lazy dog and runs home."
CALL_TEXT = (
    '<tool_call>{"name":"calculator","arguments":{"expression":"12*34"}}</tool_call>'  # 64 tiny tokens
)
PARAMS = SamplingParams(max_tokens=1, temperature=1.0, seed=7)


# ---------------------------------------------------------------------------------------------- backends
class NullBackend:
    """Returns ``n`` fixed ids per request at once (no eos: finish "length"): the gateway's own cost remains."""

    def __init__(self, tok: Any, n: int) -> None:
        base = tok(NULL_TEXT, add_special_tokens=False)["input_ids"]
        self.ids = list(itertools.islice(itertools.cycle(base), n))

    def __call__(self, requests: list[TurnRequest], params: SamplingParams) -> list[Generation]:
        return [
            Generation(self.ids[: r.max_tokens], [-1.0] * min(len(self.ids), r.max_tokens), "length")
            for r in requests
        ]


class Timed:
    """A backend wrapper that charges each request the wall time of the backend call that served it (the
    engine thread is the only caller: per sample id, one entry per call, in order)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.served: dict[int, list[float]] = defaultdict(list)

    def __call__(self, requests: list[TurnRequest], params: SamplingParams) -> list[Generation]:
        start = time.perf_counter()
        out = self.inner(requests, params)
        seconds = time.perf_counter() - start
        for r in requests:
            self.served[r.sample_id].append(seconds)
        return out


class FirstTurnCalls:
    """The engine's turns, but a trajectory's first turn (position 0) returns ``call_ids`` (a calculator call +
    eos) after the engine sampled as many tokens: the random model never writes a call itself."""

    def __init__(self, engine: NativeEngine, call_ids: list[int]) -> None:
        self.engine, self.call_ids = engine, call_ids

    def __call__(self, requests: list[TurnRequest], params: SamplingParams) -> list[Generation]:
        sized = [
            dataclasses.replace(r, max_tokens=min(r.max_tokens, len(self.call_ids))) if r.position == 0 else r
            for r in requests
        ]
        out = engine_generate(self.engine, params)(sized)
        for k, r in enumerate(sized):
            if r.position == 0:
                ids = self.call_ids[: r.max_tokens]
                logprobs = (list(out[k].logprobs) + [0.0] * len(ids))[: len(ids)]
                out[k] = Generation(ids, logprobs, "eos" if len(ids) == len(self.call_ids) else "length")
        return out


# ---------------------------------------------------------------------------------------------- part 1
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def openai_caller(url: str, key: str, tokens: int):
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)

    def call(messages: list[dict]) -> dict:
        msg = client.chat.completions.create(model="policy", messages=messages, max_tokens=tokens)
        return msg.choices[0].message.model_dump(exclude_none=True)

    return call, client.close


def http_caller(url: str, key: str, tokens: int):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    def call(messages: list[dict]) -> dict:
        body = json.dumps({"model": "policy", "messages": messages, "max_tokens": tokens})
        conn.request("POST", f"{parts.path}/chat/completions", body=body, headers=headers)
        response = conn.getresponse()
        data = json.loads(response.read())
        if response.status != 200:
            raise RuntimeError(f"gateway answered {response.status}: {data}")
        return data["choices"][0]["message"]

    return call, conn.close


def session_worker(
    gw: Gateway, ids: Any, rounds: int, args: argparse.Namespace, client: str, out: list
) -> None:
    """``rounds`` sessions in a row, each ``calls_per_session`` calls; appends (sample id, latencies)."""
    make = openai_caller if client == "openai" else http_caller
    for _ in range(rounds):
        sample_id = next(ids)
        handle = gw.open_session(sample_id=sample_id, params=PARAMS, max_response_tokens=1 << 20)
        call, close = make(handle.base_url, handle.api_key, args.null_tokens)
        messages = [{"role": "user", "content": f"Session {sample_id}: tell me a story."}]
        latencies = []
        for k in range(args.calls_per_session):
            start = time.perf_counter()
            reply = call(messages)
            latencies.append(time.perf_counter() - start)
            messages += [
                {"role": "assistant", "content": reply.get("content") or ""},
                {"role": "user", "content": f"Go on ({k})."},
            ]
        close()
        gw.close_session(handle.id)
        out.append((sample_id, latencies))


def overhead_run(gw: Gateway, timed: Timed, sessions: int, args: argparse.Namespace, client: str, calls: int):
    """Per-call overheads (s), latencies (s) and engine times (s) of ``sessions`` concurrent clients."""
    rounds = max(1, -(-calls // (sessions * args.calls_per_session)))
    ids, out = itertools.count(len(timed.served) + 10_000), []
    threads = [
        threading.Thread(target=session_worker, args=(gw, ids, rounds, args, client, out))
        for _ in range(sessions)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    overheads, latencies, engine = [], [], []
    for sample_id, lat in out:
        served = timed.served[sample_id]
        assert len(served) == len(lat), f"session {sample_id}: {len(served)} engine entries, {len(lat)} calls"
        overheads += [a - b for a, b in zip(lat, served)]
        latencies += lat
        engine += served
    return overheads, latencies, engine, wall


def part1(tok: Any, engine: NativeEngine, args: argparse.Namespace) -> list[dict[str, str]]:
    rows = []
    for backend_name in args.backends.split(","):
        inner = (
            NullBackend(tok, args.null_tokens) if backend_name == "null" else engine_generate_backend(engine)
        )
        timed = Timed(inner)
        with Gateway(timed, tok, max_model_len=engine.max_model_len) as gw:
            for client in args.clients.split(","):
                for sessions in args.sessions:
                    engine.release_memory()
                    engine.wake_up()
                    overhead_run(
                        gw, timed, sessions, args, client, sessions * args.calls_per_session
                    )  # warm-up
                    calls = args.calls if backend_name == "null" else args.native_calls
                    ov, lat, eng, wall = overhead_run(gw, timed, sessions, args, client, calls)
                    rows.append(
                        {
                            "backend": backend_name,
                            "client": client,
                            "sessions": str(sessions),
                            "calls": str(len(ov)),
                            "overhead p50 ms": f"{percentile(ov, 0.5) * 1e3:.2f}",
                            "overhead p95 ms": f"{percentile(ov, 0.95) * 1e3:.2f}",
                            "latency p50 ms": f"{percentile(lat, 0.5) * 1e3:.2f}",
                            "engine p50 ms": f"{percentile(eng, 0.5) * 1e3:.2f}",
                            "overhead share": f"{sum(ov) / sum(lat):.0%}",
                            "calls/s": f"{len(ov) / wall:.0f}",
                        }
                    )
                    print(f"  part 1: {rows[-1]}", file=sys.stderr)
    return rows


def engine_generate_backend(engine: NativeEngine):
    def backend(requests: list[TurnRequest], params: SamplingParams) -> list[Generation]:
        return engine_generate(engine, params)(requests)

    return backend


# ---------------------------------------------------------------------------------------------- part 2
def calc_rows(n: int) -> list[dict[str, Any]]:
    return [
        {"prompt": f"Problem {i}: what is {12 + i % 7} times {34 + i % 5}? Use the calculator."}
        for i in range(n)
    ]


def native_run(backend: FirstTurnCalls, tok: Any, rows: list[dict], length: int) -> tuple[float, int, int]:
    """Seconds, response tokens and model calls of the native loop over ``rows``."""
    loop = MultiTurnConfig(max_assistant_turns=4, max_user_turns=4, max_tokens_per_turn=length)
    settings = MultiTurnSettings(loop, max_response_length=length)
    start = time.perf_counter()
    trajs = run_trajectories(rows, lambda row: CalculatorEnv(), lambda r: backend(r, PARAMS), tok, settings)
    seconds = time.perf_counter() - start
    return seconds, sum(len(t.response_ids) for t in trajs), sum(t.num_assistant_turns for t in trajs)


async def harness(handle: Any, row: dict, tools: list[dict], length: int) -> None:
    """The calculator loop as an openai-client agent: chat, run the tool calls, send their results, chat."""
    client = openai.AsyncOpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0, timeout=600)
    messages: list[dict] = [{"role": "user", "content": row["prompt"]}]
    try:
        for _ in range(4):
            try:
                reply = await client.chat.completions.create(
                    model="policy", messages=messages, tools=tools, max_tokens=length
                )
            except openai.BadRequestError:  # the trajectory's token budget is spent
                return
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls or reply.choices[0].finish_reason == "length":
                return
            for call in message.tool_calls:
                result = calculator(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()


def gateway_run(gw: Gateway, rows: list[dict], length: int) -> tuple[float, int, int]:
    """Seconds, response tokens and model calls of the harness path over ``rows`` (sessions, assembly)."""
    tools = CalculatorEnv().tool_schemas()

    async def one(k: int):
        handle = gw.open_session(
            sample_id=k, params=PARAMS, max_response_tokens=length, max_tokens_per_turn=length
        )
        try:
            await harness(handle, rows[k], tools, length)
        finally:
            records = gw.close_session(handle.id)
        return assemble(records, "last", length, k).trajectory, len(records)

    async def every():
        return await asyncio.gather(*(one(k) for k in range(len(rows))))

    start = time.perf_counter()
    out = asyncio.run(every())
    seconds = time.perf_counter() - start
    return seconds, sum(len(t.response_ids) for t, _ in out), sum(n for _, n in out)


def part2(tok: Any, engine: NativeEngine, args: argparse.Namespace) -> list[dict[str, str]]:
    call_ids = tok(CALL_TEXT, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    backend = FirstTurnCalls(engine, call_ids)
    rows = calc_rows(args.trajectories)
    table = []
    with Gateway(backend, tok, max_model_len=engine.max_model_len) as gw:
        for length in args.lengths:
            runs = {
                "native": lambda n=length: native_run(backend, tok, rows, n),
                "gateway": lambda n=length: gateway_run(gw, rows, n),
            }
            times: dict[str, list[float]] = {name: [] for name in runs}
            counts = {}
            first = 0 if length == args.lengths[0] else 1  # one warm-up round, before the first length
            for repeat in range(first, args.repeats + 1):
                for name, fn in runs.items():
                    engine.release_memory()
                    engine.wake_up()
                    seconds, tokens, calls = fn()
                    counts[name] = (tokens, calls)
                    if repeat:
                        times[name].append(seconds)
                print(f"  part 2, length {length}, round {repeat}: {counts} {times}", file=sys.stderr)
            med = {name: statistics.median(t) for name, t in times.items()}
            table.append(
                {
                    "max_response_length": str(length),
                    "response tokens native / gateway": f"{counts['native'][0]} / {counts['gateway'][0]}",
                    "model calls native / gateway": f"{counts['native'][1]} / {counts['gateway'][1]}",
                    "native traj/s": f"{len(rows) / med['native']:.1f}",
                    "gateway traj/s": f"{len(rows) / med['gateway']:.1f}",
                    "gateway time / native": f"{med['gateway'] / med['native']:.2f}",
                    "runs (s) native": " ".join(f"{t:.2f}" for t in times["native"]),
                    "runs (s) gateway": " ".join(f"{t:.2f}" for t in times["gateway"]),
                }
            )
    return table


# ---------------------------------------------------------------------------------------------- main
def print_table(title: str, table: list[dict[str, str]]) -> None:
    print(f"\n{title}\n")
    header = list(table[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in table:
        print("| " + " | ".join(row[h] for h in header) + " |")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick", action="store_true", help="a small run: fewer calls, 16 trajectories, one length"
    )
    p.add_argument("--sessions", type=ints, default=[1, 16, 64], help="concurrent sessions of part 1")
    p.add_argument("--calls", type=int, default=320, help="timed calls per part-1 setting (at least)")
    p.add_argument("--calls-per-session", type=int, default=10, help="calls in a row per session")
    p.add_argument(
        "--null-tokens", type=int, default=16, help="tokens per call (the null backend returns these)"
    )
    p.add_argument("--native-calls", type=int, default=60, help="timed calls per setting, native backend")
    p.add_argument(
        "--nagle",
        action="store_true",
        help="experiment: the server's sockets with Nagle's algorithm on (as before TCP_NODELAY was set)",
    )
    p.add_argument("--backends", default="null,native", help="part-1 backends: null and/or native")
    p.add_argument(
        "--clients", default="openai,http", help="part-1 clients: openai and/or http (http.client)"
    )
    p.add_argument("--trajectories", type=int, default=64, help="part-2 trajectories at once")
    p.add_argument("--lengths", type=ints, default=[128, 256], help="part-2 max_response_length values")
    p.add_argument("--repeats", type=int, default=3, help="part-2 timed runs of each path (alternated)")
    p.add_argument("--parts", default="1,2", help="which parts to run")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.calls, args.native_calls = [1, 16], 40, 20
        args.trajectories, args.lengths, args.repeats = 16, [128], 1
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if args.nagle:  # the experiment of --nagle: an answer's body waits for the client's delayed ACK
        server_module._Handler.disable_nagle_algorithm = False
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0).eval()
    engine = NativeEngine(
        model,
        [tok.eos_token_id],
        tok.pad_token_id,
        max_num_seqs=max(64, args.trajectories),
        max_model_len=2048,
    )
    parts = args.parts.split(",")
    if "1" in parts:
        print_table(
            f"Overhead per call (chat, {args.null_tokens} tokens a call, {args.calls_per_session} calls a session)",
            part1(tok, engine, args),
        )
    if "2" in parts:
        print_table(
            f"Calculator trajectories, {args.trajectories} at once (medians of {args.repeats} alternating runs)",
            part2(tok, engine, args),
        )
    print(
        f"\nMachine: {cpu_name()}, {os.cpu_count()} logical CPUs, torch threads 1; server TCP_NODELAY {not args.nagle}; "
        f"load average "
        f"{os.getloadavg()[0]:.1f} at the end."
    )


if __name__ == "__main__":
    main()
