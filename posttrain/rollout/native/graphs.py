"""Fixed-shape decode steps: compiled with ``torch.compile`` and, on CUDA, replayed as CUDA graphs.

Used when the engine's ``enforce_eager`` is False, for steps that only decode (no prefill chunk). Shapes are
made static by rounding the slot range and the key length up to powers of two: idle slots in the range decode a
dummy token whose keys go to the cache's scratch column (never read), and keys beyond a slot's position are
masked. So a handful of shapes cover a whole rollout.

On CUDA each shape is captured once as a ``torch.cuda.CUDAGraph`` (public API) around the compiled step and
replayed with new inputs copied into its static buffers. The graphs are captured by the engine rather than by
``torch.compile(mode="reduce-overhead")`` because the KV cache is freed by ``release_memory`` between rollouts
and re-allocated at a new address: explicit graphs are simply re-captured then (the engine drops this object when
the cache generation changes), with no recompilation. The CUDA path is written against public APIs; CI has no GPU,
and it was run by hand on an H100 (docs/rollout.md).
"""

from __future__ import annotations

import torch

from posttrain.rollout.native.decoder import DecoderParts, SlotKVCache, StepInputs, forward_step

_MIN_BUCKET = 8


def bucket(value: int, cap: int) -> int:
    """``value`` rounded up to a power of two (at least 8), at most ``cap``."""
    size = _MIN_BUCKET
    while size < value:
        size *= 2
    return min(size, cap)


def decode_fixed(
    parts: DecoderParts,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    tokens: torch.Tensor,
    positions: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """One decode token for each of slots ``0..S-1`` (tokens, positions: [S]); logits [S, V].

    Keys at positions ``<= positions[s]`` (and below ``length``) are visible to slot s; idle slots carry the
    scratch position, so they write there and see every key (their output is ignored).
    """
    span = tokens.shape[0]
    keys = torch.arange(length, device=tokens.device)
    inputs = StepInputs(
        input_ids=tokens,
        positions=positions,
        slots=torch.arange(span, device=tokens.device),
        num_decode=span,
        decode_span=span,
        decode_len=length,
        decode_mask=(keys[None, :] <= positions[:, None])[:, None, None, :],
    )
    return forward_step(parts, k_cache, v_cache, inputs)


class StaticDecoder:
    """Runs decode-only steps at bucketed fixed shapes over ``cache`` (see the module docstring)."""

    def __init__(self, parts: DecoderParts, cache: SlotKVCache):
        self.parts, self.cache = parts, cache
        self.cache_generation = cache.generation
        self.device = parts.device
        self._compiled = torch.compile(decode_fixed)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None

    def __call__(self, decode: list[tuple[int, int, int]]) -> torch.Tensor:
        """decode: [(slot, position, token)]; returns logits [S, V] indexed by slot (S >= every slot + 1)."""
        span = bucket(max(s for s, _, _ in decode) + 1, self.cache.slots)
        length = bucket(max(p for _, p, _ in decode) + 1, self.cache.length)
        tokens = [0] * span
        positions = [self.cache.length] * span  # idle slots: the scratch column
        for slot, position, token in decode:
            tokens[slot], positions[slot] = token, position
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        positions_t = torch.tensor(positions, dtype=torch.long, device=self.device)
        if self.device.type != "cuda":
            return self._compiled(self.parts, self.cache.k, self.cache.v, tokens_t, positions_t, length)
        graph = self._graphs.get((span, length))
        if graph is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = _Graph(self._compiled, self.parts, self.cache, tokens_t, positions_t, length, self._pool)
            self._graphs[(span, length)] = graph
        return graph.replay(tokens_t, positions_t)


class _Graph:
    """One captured decode step on CUDA with static input buffers."""

    def __init__(self, fn, parts, cache, tokens, positions, length, pool):
        self.tokens, self.positions = tokens.clone(), positions.clone()
        args = (parts, cache.k, cache.v, self.tokens, self.positions, length)
        # Warm up (compile, allocate) on a side stream before capture, as CUDA graph capture requires. The
        # warm-up runs the real step's inputs: it writes the same keys/values the replay will, so it is harmless.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn(*args)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = fn(*args)

    def replay(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        return self.logits.clone()  # the next replay overwrites the graph's output buffer
