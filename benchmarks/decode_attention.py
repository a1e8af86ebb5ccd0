"""What limits the native engine's decode attention on CPU: reading the KV cache, or the attention itself.

Run::

    OMP_NUM_THREADS=1 python3 benchmarks/decode_attention.py

The shapes of the tiny Qwen2's 8x8x128 GRPO rollout (docs/performance.md): 64 slots, 2 KV heads with 2 query
heads each, head size 64, a cache of 146 positions per slot (fp32), at key lengths of 40, 81 and 145. Each row
is the median of 30 timed calls per layer over 4 layers' caches, with a 32 MB buffer written between calls so
that the caches come from memory as in a real step (where the rest of the model evicts them). Printed per
formulation: ms per layer and the rate at which it consumes keys and values (GB/s):

- ``read keys and values``: summing the same keys and values, the memory's share of the work;
- ``sdpa (the engine)``: ``F.scaled_dot_product_attention`` with the engine's boolean mask;
- ``bmm, keys on the left``: ``[L x 64] x [64 x 2]`` products, softmax over the keys, then ``[2 x L] x [L x 64]``.
  Its sums run in another order than sdpa's (other samples), and its sum over keys depends on the longest
  sequence of a step, so the engine does not use it; it shows what the per-pair small products cost.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

SLOTS, KV_HEADS, GROUP, HEAD, CACHE = 64, 2, 2, 64, 146
LAYERS, REPEATS, SCALE = 4, 30, HEAD**-0.5


def read(q, k, v, mask, additive):
    return k.sum() + v.sum()


def sdpa(q, k, v, mask, additive):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)


def bmm_keys_left(q, k, v, mask, additive):
    batch, length = SLOTS * KV_HEADS, k.shape[2]
    scores = torch.bmm(k.reshape(batch, length, HEAD), q.reshape(batch, GROUP, HEAD).transpose(1, 2))
    scores = scores.view(SLOTS, KV_HEADS, length, GROUP).mul_(SCALE).add_(additive)
    weights = torch.softmax(scores, dim=2).view(batch, length, GROUP).transpose(1, 2)
    return torch.bmm(weights, v.reshape(batch, length, HEAD))


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = (SLOTS, KV_HEADS, CACHE + 1, HEAD)
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]
    evict = torch.zeros(8 << 20)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    print(f"{'key length':>10}  {'formulation':<24} {'ms/layer':>9} {'GB/s':>6}")
    for length in (40, 81, 145):
        q = torch.randn(SLOTS, KV_HEADS, GROUP, HEAD)
        position = torch.randint(length // 2, length, (SLOTS,))
        position[0] = length - 1
        mask = (torch.arange(length)[None] <= position[:, None])[:, None, None, :]
        additive = torch.zeros(SLOTS, 1, length, 1).masked_fill(
            ~mask.view(SLOTS, 1, length, 1), float("-inf")
        )
        formulations = (
            ("read keys and values", read),
            ("sdpa (the engine)", sdpa),
            ("bmm, keys on the left", bmm_keys_left),
        )
        for name, fn in formulations:
            times = []
            for _ in range(REPEATS):
                evict.add_(1.0)
                start = time.perf_counter()
                for k, v in caches:
                    fn(q, k[:, :, :length], v[:, :, :length], mask, additive)
                times.append((time.perf_counter() - start) / LAYERS)
            ms = statistics.median(times) * 1e3
            gigabytes = 2 * SLOTS * KV_HEADS * length * HEAD * 4 / 1e9
            print(f"{length:>10}  {name:<24} {ms:>9.3f} {gigabytes / ms * 1e3:>6.1f}")


if __name__ == "__main__":
    main()
