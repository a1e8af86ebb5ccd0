"""Prefix grouper benchmark: one micro-batch's forward+backward, padded vs packed vs prompts shared.

Run: ``python3 benchmarks/bench_prefix_grouper.py`` (about two minutes on 2 CPU cores).

A micro-batch of ``--groups`` prompts x ``--n`` samples (GRPO's layout: a prompt's samples next to each other)
goes through :func:`posttrain.forward.passes.policy_logprobs` and the sum of the log-probs is backpropagated, on
the built-in tiny Qwen2 (random weights, fp32, sdpa, one thread). Shapes: prompt and response lengths per row
of the table (responses vary uniformly between half and all of the given length). Layouts:

- ``padded``: left-padded prompts, right-padded responses (``ForwardOptions()``, verl's default);
- ``packed``: ``model.use_remove_padding`` with the default 512-token rows;
- ``grouped``: ``actor.use_prefix_grouper`` (one row: each prompt once, every response, no padding; attention
  per sequence through the shared-prefix attention, which the model is loaded with: sdpa for the other layouts).

``tokens`` is what the model body computes (padded: rows x width; packed: real tokens; grouped: one prompt per
group + every response). Times are medians of ``--repeats`` alternated runs (CPU seconds of the process).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.data.batch import RolloutBatch, build_rollout_batch  # noqa: E402
from posttrain.forward.passes import ForwardOptions, policy_logprobs  # noqa: E402
from posttrain.forward.prefix_grouper import group_by_prompt  # noqa: E402
from posttrain.forward.shared_prefix import register_shared_prefix_attention  # noqa: E402
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from posttrain.utils.console import print_table  # noqa: E402

LAYOUTS = {
    "padded": ForwardOptions(),
    "packed": ForwardOptions(remove_padding=True),
    "grouped": ForwardOptions(prefix_grouper=True),
}


def micro_batch(
    groups: int, n: int, prompt_len: int, response_len: int, vocab: int, seed: int
) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompts, responses, ids = [], [], []
    for k in range(groups):
        prompt = torch.randint(5, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(n):
            length = int(torch.randint(max(1, response_len // 2), response_len + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(5, vocab, (length,), generator=g).tolist())
            ids.append(k)
    return build_rollout_batch(prompts, responses, ids, pad_token_id=0)


def computed_tokens(batch: RolloutBatch, layout: str) -> int:
    if layout == "padded":
        return int(batch.input_ids.numel())
    if layout == "packed":
        return int(batch.attention_mask.sum())
    groups = group_by_prompt(batch)
    return int(batch.attention_mask.sum()) - groups.prompt_tokens_saved


def forward_backward(model: torch.nn.Module, batch: RolloutBatch, options: ForwardOptions) -> float:
    start = time.process_time()
    logprobs, _ = policy_logprobs(model, batch, options=options)
    logprobs.sum().backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["17:8", "17:64", "128:32", "128:128"],
        help="prompt_len:max_response_len pairs, one table row group each",
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("command: python3 " + " ".join(sys.argv))
    print(f"torch {torch.__version__}, 1 thread; load average at start: {os.getloadavg()}")
    model = build_tiny_model(build_tiny_tokenizer(), seed=0).train()
    model.config._attn_implementation = register_shared_prefix_attention()  # sdpa in the other layouts' calls
    rows = []
    for shape in args.shapes:
        prompt_len, response_len = (int(x) for x in shape.split(":"))
        batch = micro_batch(args.groups, args.n, prompt_len, response_len, model.config.vocab_size, seed=0)
        times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
        for options in LAYOUTS.values():
            forward_backward(model, batch, options)  # warm-up
        for _ in range(args.repeats):
            for name, options in LAYOUTS.items():
                times[name].append(forward_backward(model, batch, options))
        base = statistics.median(times["padded"])
        for name in LAYOUTS:
            t = statistics.median(times[name])
            rows.append(
                {
                    "prompt": prompt_len,
                    "response": f"{response_len // 2}-{response_len}",
                    "layout": name,
                    "tokens": computed_tokens(batch, name),
                    "median CPU s": round(t, 3),
                    "speed-up vs padded": round(base / t, 2),
                }
            )
    print_table(
        f"forward+backward of {args.groups} prompts x n={args.n}, tiny Qwen2 fp32, 1 thread, "
        f"median of {args.repeats} alternated runs",
        rows,
    )
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
