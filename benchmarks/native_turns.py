"""Multi-turn rollout on the native engine: 3 turns with session prefix reuse vs every turn prefilled in full.

Run: ``python3 benchmarks/native_turns.py`` (about a minute on 2 CPU cores; ``--help`` for options).

Model: the built-in tiny Qwen2 (``posttrain.models.tiny``: hidden 256, 4 layers, 4 heads, 2 KV heads, vocabulary
512), random weights from seed 0, fp32. ``--trajectories`` trajectories, each a ``--prompt-tokens``-token prompt
(random ids), play ``--turns`` turns: each turn sends the whole context to ``NativeEngine.generate_turns``
(at most ``--turn-tokens`` sampled tokens, temperature 1), then ``--env-tokens`` "environment" ids are appended.
Untrained weights rarely emit eos, so most turns run to the limit on both sides: equal work but for the prefill.

- **reuse**: requests carry their trajectory's session; the engine keeps each trajectory's slot between turns and
  prefills only what a turn adds (the environment's ids and the previous turn's last token).
- **full**: the same requests without sessions: every turn prefills its whole context.

Both engines use ``max_model_len`` = the longest trajectory, so the cache is allocated once. One warm-up run
each, then ``--repeats`` runs alternated; medians of CPU seconds of this process (one thread) and wall seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from posttrain.rollout.base import SamplingParams, TurnRequest  # noqa: E402
from posttrain.rollout.native.engine import NativeEngine  # noqa: E402


def play(engine: NativeEngine, prompts: list[list[int]], args, sessions: bool) -> tuple[float, float, dict]:
    """All turns of all trajectories; returns (cpu s, wall s, summed prefill counts)."""
    ids = [list(p) for p in prompts]
    position = [0] * len(prompts)
    counts = {"rollout/prefill_tokens": 0.0, "rollout/prefill_reused_tokens": 0.0}
    params = SamplingParams(max_tokens=1, seed=5)
    cpu, wall = time.process_time(), time.perf_counter()
    for turn in range(args.turns):
        requests = [
            TurnRequest(
                ids=list(ids[i]),
                max_tokens=args.turn_tokens,
                sample_id=i,
                position=position[i],
                session=i if sessions else None,
            )
            for i in range(len(prompts))
        ]
        out = engine.generate_turns(requests, params)
        for key, value in engine.generation_metrics().items():
            counts[key] += value
        env = [100 + (turn * 7 + k) % 300 for k in range(args.env_tokens)]
        for i, response in enumerate(out.response_ids):
            ids[i] += response + env
            position[i] += len(response) + len(env)
    return time.process_time() - cpu, time.perf_counter() - wall, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--turn-tokens", type=int, default=24)
    parser.add_argument("--env-tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 500, (args.trajectories, args.prompt_tokens), generator=gen).tolist()
    longest = args.prompt_tokens + args.turns * (args.turn_tokens + args.env_tokens)
    engines = {
        name: NativeEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, max_model_len=longest)
        for name in ("reuse", "full")
    }
    times: dict[str, list[tuple[float, float]]] = {"reuse": [], "full": []}
    counts = {}
    for repeat in range(args.repeats + 1):
        for name, engine in engines.items():
            engine.sync_weights([])  # a new rollout phase: sessions end
            cpu, wall, counts[name] = play(engine, prompts, args, sessions=name == "reuse")
            if repeat:
                times[name].append((cpu, wall))
    print(
        f"{args.trajectories} trajectories x {args.turns} turns, prompt {args.prompt_tokens} tokens, "
        f"{args.turn_tokens} sampled + {args.env_tokens} environment tokens per turn, {args.threads} thread(s)"
    )
    print(f"{'':6} {'cpu s':>7} {'wall s':>7} {'prefilled':>10} {'reused':>8}")
    for name in ("full", "reuse"):
        cpu = statistics.median(t[0] for t in times[name])
        wall = statistics.median(t[1] for t in times[name])
        c = counts[name]
        print(
            f"{name:6} {cpu:7.2f} {wall:7.2f} {int(c['rollout/prefill_tokens']):>10} "
            f"{int(c['rollout/prefill_reused_tokens']):>8}"
        )
    full = statistics.median(t[0] for t in times["full"])
    reuse = statistics.median(t[0] for t in times["reuse"])
    print(f"reuse / full CPU time: {reuse / full:.2f}")


if __name__ == "__main__":
    main()
