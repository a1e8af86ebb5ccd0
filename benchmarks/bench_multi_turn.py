"""Multi-turn rollouts against single-turn rollouts of the same tokens: time per token, prefix reuse, tool latency.

Run (one thread; in the environment with vLLM to include the vLLM engine, else the native engine only):
``OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/bench_multi_turn.py`` (``--help``).

Workload: ``--trajectories`` rows, each a system prompt all rows share (``--system-words``: a stand-in for tool
descriptions and rules) and a distinct short user message, rendered with the tiny tokenizer's chat template.
Multi-turn: the agents driver (``run_trajectories``) runs 3 assistant turns of ``--turn-tokens`` sampled tokens
each; after turns 1 and 2 a synthetic environment waits for its "tool" (``asyncio.sleep``, row i waits
``--tool-s`` x (i mod 4) / 3, so trajectories fall out of step as real tools make them) and answers with a fixed
short tool message (mask 0). Two single-turn baselines, ``engine.generate`` on the same rendered prompts:
"single-turn" samples ``3 x --turn-tokens`` tokens (as many as the trajectories' assistant turns) and
"single-turn, as long as a trajectory" samples as many as a trajectory's whole response, assistant and
environment tokens (the same total tokens).

Turns end at the per-turn limit. The random tiny model seldom emits its end-of-turn token, so the benchmark
reports such a turn as ended (finish reason "stop") and the driver closes it with the template's eos, as it does
for a model that stopped on its own: every trajectory gets exactly 3 turns.

Modes: ``reuse`` (the driver gives each trajectory's turns one session: the engine keeps or re-finds the
keys/values of the context so far), ``no reuse`` (``session=None``: every turn prefills its whole context).

Each run starts from an empty cache (``release_memory`` before it; the same seeds give the same trajectories
every round, and their keys/values must not be found from the round before).

Model: the built-in tiny Qwen2 (``posttrain.models.tiny``: hidden 256, 4 layers, head size 64), random weights
from seed 0, fp32. One untimed warm-up per engine and mode, then ``--repeats`` rounds, modes alternated within
a round; medians of wall seconds.
"per sampled token / single-turn": seconds per sampled token of the mode over that of "single-turn" (the strict
ratio: the trajectories also prefill their environment's tokens); "per response token / single-turn as long":
seconds per response token (assistant and environment) over that of the baseline as long as a trajectory. The goal
is <= 1.25; the ratio of the fastest runs is in brackets (on a shared machine the minimum is the steadier figure).
"time in engine": the share of the (warm-up) run's wall time spent inside engine calls; the rest is the driver,
rendering, and waiting for tools. Below the table: the tools' waiting that shows in the wall time, beyond the
slowest trajectory's own waits (which nothing can overlap with that trajectory's next turn). Prefill counts are per run (the warm-up's).
Quote figures with the machine they came from and how busy it was.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from rollout_backends import cpu_name  # noqa: E402

from posttrain.agents.driver import Generation, MultiTurnSettings, run_trajectories  # noqa: E402
from posttrain.agents.env import Environment, StepResult  # noqa: E402
from posttrain.agents.render import Renderer  # noqa: E402
from posttrain.config.schema.agents import MultiTurnConfig  # noqa: E402
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from posttrain.rollout.base import SamplingParams, TurnRequest  # noqa: E402
from posttrain.rollout.native.engine import NativeEngine  # noqa: E402

TURNS = 3
TOOL_REPLY = "result: 42, status ok"
WORDS = ["apples", "rivers", "numbers", "stars", "trains", "clocks", "birds", "maps"]


class FixedReplyEnv(Environment):
    """Answers each assistant turn with the same short tool message after a sleep; done after ``TURNS`` turns."""

    def __init__(self, row: dict[str, Any], tool_s: float) -> None:
        self.delay = tool_s * (row["index"] % 4) / 3
        self.turns = 0

    async def step(self, text: str) -> StepResult:
        self.turns += 1
        if self.turns >= TURNS:
            return StepResult(done=True)
        await asyncio.sleep(self.delay)
        return StepResult([{"role": "tool", "content": TOOL_REPLY}])


class TurnAdapter:
    """The driver's ``generate(requests)`` over an engine's ``generate_turns``, counting calls, engine time and
    prefill tokens. ``reuse=False`` drops each request's session (the engine then prefills whole contexts).
    Turns cut at their limit are reported as ended (see the module docstring)."""

    def __init__(self, engine: Any, params: SamplingParams, reuse: bool) -> None:
        self.engine, self.params, self.reuse = engine, params, reuse
        self.prefill = {"rollout/prefill_tokens": 0.0, "rollout/prefill_reused_tokens": 0.0}
        self.calls = 0
        self.engine_s = 0.0  # wall seconds inside the engine's calls

    def __call__(self, requests: list[TurnRequest]) -> list[Generation]:
        if not self.reuse:
            requests = [dataclasses.replace(r, session=None) for r in requests]
        start = time.perf_counter()
        out = self.engine.generate_turns(requests, self.params)
        self.engine_s += time.perf_counter() - start
        self.calls += 1
        metrics = self.engine.generation_metrics()
        for key in self.prefill:
            self.prefill[key] += metrics.get(key, 0.0)
        return [Generation(ids, lps, "stop") for ids, lps in zip(out.response_ids, out.response_logprobs)]


def multi_turn(engine: Any, rows: list[dict], tok: Any, args: argparse.Namespace, reuse: bool, tool_s: float):
    """Seconds, sampled tokens, prefill counts and mean turns of one batch of 3-turn trajectories."""
    loop = MultiTurnConfig(
        max_assistant_turns=TURNS, max_user_turns=TURNS, max_tokens_per_turn=args.turn_tokens
    )
    settings = MultiTurnSettings(loop, max_response_length=TURNS * (args.turn_tokens + 32))
    adapter = TurnAdapter(engine, SamplingParams(max_tokens=1, temperature=1.0, seed=1), reuse)
    start = time.perf_counter()
    trajs = run_trajectories(rows, lambda row: FixedReplyEnv(row, tool_s), adapter, tok, settings)
    seconds = time.perf_counter() - start
    tokens = sum(t.assistant_tokens for t in trajs)
    response = sum(len(t.response_ids) for t in trajs)
    turns = statistics.mean(t.num_assistant_turns for t in trajs)
    return seconds, tokens, response, adapter.prefill, turns, (adapter.calls, adapter.engine_s / seconds)


def single_turn(engine: Any, prompt_ids: list[list[int]], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1)
    start = time.perf_counter()
    out = engine.generate(prompt_ids, params)
    seconds = time.perf_counter() - start
    metrics = engine.generation_metrics()
    prefill = {k: v for k, v in metrics.items() if k.startswith("rollout/prefill")}
    tokens = sum(out.response_lengths)
    return seconds, tokens, tokens, prefill, 1.0, (1, 1.0)


SAMPLED = "single-turn"
TOTAL = "single-turn, as long as a trajectory"


def ratio(med: dict, low: dict, mode: str, tokens: int, base: str, base_tokens: int) -> str:
    """Seconds per token of ``mode`` over those of the baseline ``base``: medians, and (in brackets) minima."""
    return f"{(med[mode] / tokens) / (med[base] / base_tokens):.2f} ({(low[mode] / tokens) / (low[base] / base_tokens):.2f})"


def run(fn: Any, engine: Any) -> tuple:
    """One timed run from an empty cache: ``release_memory`` ends the sessions and empties the prefix cache, so
    no run reads what an earlier run of the same trajectories left there."""
    engine.release_memory()
    engine.wake_up()
    return fn(engine)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=16, help="rows (one trajectory each)")
    p.add_argument("--turn-tokens", type=int, default=32, help="sampled tokens per assistant turn")
    p.add_argument(
        "--tool-s", type=float, default=0.2, help="longest tool wait (row i waits tool_s*(i%%4)/3)"
    )
    p.add_argument(
        "--system-words",
        type=int,
        default=120,
        help="words of the system prompt every row shares (tools, rules)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (medians reported)")
    p.add_argument("--engines", default="native,vllm", help="native and/or vllm (vllm when importable)")
    p.add_argument(
        "--engine-costs",
        action="store_true",
        help="only each engine's prefill rate and its cost per call (see engine_costs), no table",
    )
    return p.parse_args()


def engine_costs(engine: Any, rows: int, repeats: int) -> str:
    """What a turn costs an engine apart from decoding: ``rows`` prompts of 256 new random tokens prefilled
    (``max_tokens=1``), and a call whose ``rows`` prompts are all cached (the same call again: its fixed cost);
    medians of ``repeats`` runs from an empty cache."""
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=1)
    fresh, cached = [], []
    for k in range(repeats + 1):  # the first round warms up
        prompts = torch.randint(10, 200, (rows, 256), generator=torch.Generator().manual_seed(k)).tolist()
        engine.release_memory()
        engine.wake_up()
        for times in (fresh, cached):
            start = time.perf_counter()
            engine.generate(prompts, params)
            times.append(time.perf_counter() - start)
    prefill = statistics.median(fresh[1:])
    return (
        f"{rows} x 256 new tokens prefilled in {prefill:.3f} s ({rows * 256 / prefill:,.0f} tokens/s); the same "
        f"{rows} prompts again, all cached: {statistics.median(cached[1:]) * 1e3:.1f} ms a call (medians of {repeats})"
    )


def build_engines(names: list[str], model: Any, tok: Any, directory: str, max_len: int, seqs: int) -> dict:
    eos = [tok.eos_token_id]
    engines: dict[str, Any] = {}
    if "native" in names:
        engines["native"] = NativeEngine(
            model,
            eos,
            tok.pad_token_id,
            max_num_seqs=seqs,
            max_num_batched_tokens=max(2048, max_len),
            max_model_len=max_len,
        )
    if "vllm" in names:
        try:
            import vllm  # noqa: F401
        except ImportError:
            print("vllm is not importable here: native engine only", file=sys.stderr)
            return engines
        from posttrain.rollout.vllm import VLLMEngine, VLLMKnobs

        knobs = VLLMKnobs(
            max_num_seqs=seqs,
            max_num_batched_tokens=max(2048, max_len),
            max_model_len=max_len,
            load_format="auto",
        )
        engines["vllm"] = VLLMEngine(directory, eos, dtype="fp32", seed=0, knobs=knobs)
    return engines


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    rows = [
        {
            "index": i,
            "prompt": f"Task {i}: tell me about {WORDS[i % len(WORDS)]} and {WORDS[(i * 3 + 1) % 8]}.",
        }
        for i in range(args.trajectories)
    ]
    system = " ".join(WORDS[i % len(WORDS)] for i in range(args.system_words))
    for r in rows:
        r["prompt"] = [{"role": "system", "content": system}, {"role": "user", "content": r["prompt"]}]
    prompt_ids = [Renderer(tok).prompt_ids(r["prompt"]) for r in rows]
    max_len = max(len(p) for p in prompt_ids) + TURNS * (args.turn_tokens + 32) + 64
    reuse, tools = "3 turns, reuse", f"3 turns, reuse, tools <= {args.tool_s:g} s"
    multi_modes = {
        reuse: lambda e: multi_turn(e, rows, tok, args, True, 0.0),
        "3 turns, no reuse": lambda e: multi_turn(e, rows, tok, args, False, 0.0),
        tools: lambda e: multi_turn(e, rows, tok, args, True, args.tool_s),
    }
    table, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        engines = build_engines(args.engines.split(","), model, tok, tmp, max_len, args.trajectories)
        for name, engine in engines.items():
            if args.engine_costs:
                print(f"{name}: {engine_costs(engine, args.trajectories, args.repeats)}")
                continue
            results = {
                mode: [run(fn, engine)] for mode, fn in multi_modes.items()
            }  # warm-up: tokens, prefill
            # The single-turn baselines: as many sampled tokens as a trajectory's assistant turns, and as many
            # as its whole response (assistant and environment tokens: "the same total tokens").
            per_trajectory = round(results[reuse][0][2] / len(rows))
            modes = {
                SAMPLED: lambda e: single_turn(e, prompt_ids, TURNS * args.turn_tokens),
                TOTAL: lambda e, k=per_trajectory: single_turn(e, prompt_ids, k),
                **multi_modes,
            }
            for mode in (SAMPLED, TOTAL):
                results[mode] = [run(modes[mode], engine)]
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for _ in range(args.repeats):
                for mode, fn in modes.items():
                    times[mode].append(run(fn, engine)[0])
            med = {mode: statistics.median(t) for mode, t in times.items()}
            low = {mode: min(t) for mode, t in times.items()}
            for mode in modes:
                _, tokens, response, prefill, turns, (calls, in_engine) = results[mode][0]
                single = results[SAMPLED][0][1]
                whole = results[TOTAL][0][2]
                table.append(
                    {
                        "engine": name,
                        "mode": mode,
                        "sampled tokens": str(tokens),
                        "response tokens": str(response),
                        "turns/traj": f"{turns:.1f}",
                        "engine calls": str(calls),
                        "time in engine": f"{in_engine:.0%}",
                        "s (median)": f"{med[mode]:.2f}",
                        "s (min)": f"{low[mode]:.2f}",
                        "per sampled token / single-turn": f"{ratio(med, low, mode, tokens, SAMPLED, single)}",
                        "per response token / single-turn as long": f"{ratio(med, low, mode, response, TOTAL, whole)}",
                        "prefill computed / reused": "-"
                        if not prefill
                        else f"{prefill['rollout/prefill_tokens']:.0f} / "
                        f"{prefill['rollout/prefill_reused_tokens']:.0f}",
                    }
                )
            waits = 2 * args.tool_s  # the slowest rows (i mod 4 == 3) wait tool_s after turns 1 and 2
            notes.append(
                f"{name}: with tools the run took {med[tools]:.2f} s (median); without them {med[reuse]:.2f} s, plus "
                f"the slowest trajectory's own tool waits ({waits:.2f} s): {med[reuse] + waits:.2f} s. Every "
                f"trajectory waits {sum(args.tool_s * (i % 4) / 3 for i in range(len(rows))) * 2:.1f} s for tools in "
                f"all; what shows beyond the slowest trajectory's own waits: {med[tools] - med[reuse] - waits:+.2f} s."
            )
    if args.engine_costs:
        return
    print(
        f"\nMachine: {cpu_name()}, {os.cpu_count()} logical CPUs, torch threads 1; {args.trajectories} "
        f"trajectories x {TURNS} turns x {args.turn_tokens} tokens; {args.repeats} alternating rounds; load average "
        f"{os.getloadavg()[0]:.1f} at the end.\n"
    )
    header = list(table[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in table:
        print("| " + " | ".join(row[h] for h in header) + " |")
    print()
    for line in notes:
        print(line)


if __name__ == "__main__":
    main()
