"""The native engine's fallback path: the model's own forward over left-padded rows, decoded in lockstep.

For architectures the slot cache does not support, calls beyond a sliding-window model's window, and
``use_hf_forward=True``. Rows are left-padded and prefilled once (the cache repeated for the ``n`` samples of each
prompt), then every row decodes one token per forward until all rows finished. Each row has its own global sample
id, noise offset and token limit, so the same code runs ``generate`` (offset 0, one limit) and the turns of
multi-turn trajectories (no prefix reuse here: every turn prefills its whole context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain.rollout.base import RolloutResult, SampleCallback, SamplingParams, TurnRequest, report_samples
from posttrain.rollout.native.token_sampling import sample_tokens


@dataclass
class Lockstep:
    """What the lockstep decode needs from the engine."""

    model: nn.Module
    device: torch.device
    pad_token_id: int
    eos: torch.Tensor  # [E] int64 eos ids on ``device``
    chunk_size: int  # prompts handed to the model at once


def padded_generate(
    run: Lockstep,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    seed: int,
    prompt_offset: int,
    on_sample: SampleCallback | None = None,
) -> RolloutResult:
    """``NativeEngine.generate`` on this path: ``n`` samples per prompt, prompt-major; ``on_sample`` gets each
    chunk's samples when the chunk is decoded (its rows end together)."""
    result, n = RolloutResult(), params.n
    for start in range(0, len(prompt_ids), run.chunk_size):
        chunk = prompt_ids[start : start + run.chunk_size]
        first = (prompt_offset + start) * n
        rows = len(chunk) * n
        out = lockstep_decode(
            run,
            chunk,
            n,
            params,
            seed,
            sample_ids=list(range(first, first + rows)),
            offsets=[0] * rows,
            limits=[params.max_tokens] * rows,
        )
        out.prompt_index = [start + i for i in range(len(chunk)) for _ in range(n)]
        report_samples(out, on_sample, first=len(result))
        result.extend(out)
    return result


def padded_turns(
    run: Lockstep, requests: list[TurnRequest], params: SamplingParams, seed: int
) -> RolloutResult:
    """``NativeEngine.generate_turns`` on this path: one sample per request, in request order."""
    result = RolloutResult()
    for start in range(0, len(requests), run.chunk_size):
        chunk = requests[start : start + run.chunk_size]
        out = lockstep_decode(
            run,
            [r.ids for r in chunk],
            1,
            params,
            seed,
            sample_ids=[r.sample_id for r in chunk],
            offsets=[r.position for r in chunk],
            limits=[r.max_tokens for r in chunk],
        )
        out.prompt_index = list(range(start, start + len(chunk)))
        result.extend(out)
    return result


def lockstep_decode(
    run: Lockstep,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    seed: int,
    *,
    sample_ids: list[int],
    offsets: list[int],
    limits: list[int],
) -> RolloutResult:
    """Prefill ``prompts`` once, repeat the cache ``n`` times and decode all rows in lockstep; row r (prompt
    ``r // n``) draws its k-th token with noise (seed, ``sample_ids[r]``, ``offsets[r] + k``) and stops at an
    eos or after ``limits[r]`` tokens. ``prompt_index`` of the result is left to the caller."""
    device, max_tokens = run.device, max(limits)
    logits, cache, full_mask, next_position = padded_prefill(run, prompts, n, max_tokens)
    prompt_len = full_mask.shape[1] - max_tokens
    rows = logits.shape[0]
    ids = torch.tensor(sample_ids, dtype=torch.long, device=device)
    offsets_t = torch.tensor(offsets, dtype=torch.long, device=device)
    limits_t = torch.tensor(limits, dtype=torch.long, device=device)
    tokens = torch.full((rows, max_tokens), run.pad_token_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(rows, max_tokens, dtype=torch.float32, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    for step in range(max_tokens):
        token, token_logprob = sample_tokens(
            logits,
            greedy=params.greedy,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed,
            sample_ids=ids,
            steps=offsets_t + step,
        )
        token = token.masked_fill(finished, run.pad_token_id)
        tokens[:, step] = token
        logprobs[:, step] = token_logprob.masked_fill(finished, 0.0)
        lengths += (~finished).long()
        finished |= torch.isin(token, run.eos) | (lengths >= limits_t)
        if step == max_tokens - 1 or bool(finished.all()):
            break
        out = run.model(
            input_ids=token[:, None],
            attention_mask=full_mask[:, : prompt_len + step + 1],
            position_ids=next_position,
            past_key_values=cache,
            use_cache=True,
        )
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_position = next_position + 1
    del cache
    return _lockstep_result(tokens, logprobs, lengths, run.eos)


def padded_prefill(
    run: Lockstep, chunk: list[list[int]], n: int, max_tokens: int
) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
    """Prefill the left-padded prompts once and repeat the result for their ``n`` samples each.

    Returns ``(logits, cache, full_mask, next_position)``: the last prompt position's logits ``[rows, V]`` and
    the model's KV cache, one row per sample; the attention mask ``[rows, prompt_len + max_tokens]`` (the
    decode columns already 1: every row decodes in lockstep until all finish); each row's next position id.
    """
    input_ids, attention_mask = left_pad(chunk, run.pad_token_id, run.device)
    prompt_len = input_ids.shape[1]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)  # pads get 0; they are masked anyway
    out = run.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=1,
    )
    cache = out.past_key_values
    cache.batch_repeat_interleave(n)
    logits = out.logits[:, -1, :].repeat_interleave(n, dim=0)
    rows = logits.shape[0]
    full_mask = torch.ones(rows, prompt_len + max_tokens, dtype=attention_mask.dtype, device=run.device)
    full_mask[:, :prompt_len] = attention_mask.repeat_interleave(n, dim=0)
    next_position = position_ids[:, -1:].repeat_interleave(n, dim=0) + 1
    return logits, cache, full_mask, next_position


def _lockstep_result(
    tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor, eos: torch.Tensor
) -> RolloutResult:
    """The lockstep decode's ``[rows, max_tokens]`` buffers cut to each row's length; a row that ends on an EOS id
    finished by ``eos``, any other by ``length``."""
    hit_eos = torch.isin(tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1), eos)
    lengths_l, tokens_l, logprobs_l = lengths.tolist(), tokens.tolist(), logprobs.tolist()
    return RolloutResult(
        prompt_index=[0] * len(lengths_l),
        response_ids=[row[:k] for row, k in zip(tokens_l, lengths_l)],
        response_logprobs=[row[:k] for row, k in zip(logprobs_l, lengths_l)],
        finish_reasons=["eos" if e else "length" for e in hit_eos.tolist()],
    )


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into ``input_ids`` [B, L] int64 and ``attention_mask`` [B, L] int64 (1 = token)."""
    width = max(len(r) for r in rows)
    ids = [[pad_id] * (width - len(r)) + list(r) for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(mask, dtype=torch.long, device=device),
    )
