"""In-process rollout over a Hugging Face causal LM: batched sampling with a KV cache.

Each chunk of prompts is left-padded into one batch, prefilled once, then decoded one token per step for all rows
at once; sampling (temperature, top-k, top-p, greedy) is vectorised over the batch, so the per-step Python work
does not grow with the number of rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from posttrain.rollout.base import RolloutEngine, RolloutResult, SamplingParams, validate_prompts


@dataclass
class _Decoded:
    """Output of decoding one padded batch of B rows for at most T = max_tokens steps."""

    tokens: torch.Tensor  # [B, T] int64, pad after a row finished
    logprobs: torch.Tensor  # [B, T] float32, 0 after a row finished
    lengths: torch.Tensor  # [B] int64, generated tokens per row (eos included)
    hit_eos: torch.Tensor  # [B] bool


class NativeEngine(RolloutEngine):
    """Rollout engine running a Hugging Face causal LM in this process.

    model: the policy (any ``AutoModelForCausalLM``-style module accepting ``attention_mask``, ``position_ids``,
        ``past_key_values``, ``use_cache`` and ``logits_to_keep``). Pass the trainer's module itself to share it
        (no extra memory, ``sync_weights`` is then a no-op), or a separate copy (e.g. ``copy.deepcopy(policy)``, or
        one loaded in bf16 for faster sampling) that ``sync_weights`` refreshes after each update.
    eos_token_ids: a sample finishes when it emits any of these ids.
    pad_token_id: fills the left padding of prompts and the tail of finished rows.
    chunk_size: maximum number of prompts handed to the model at once (``chunk_size * n`` rows per forward), so
        rollout memory stays flat however many prompts a step has. Results do not depend on it except through
        the order random numbers are drawn in.
    device: where to run; defaults to the model's device. The model is moved there if it is elsewhere.
    """

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        chunk_size: int = 64,
        device: str | torch.device | None = None,
    ):
        if len(eos_token_ids) == 0:
            raise ValueError("eos_token_ids is empty; pass at least one id, e.g. [tokenizer.eos_token_id]")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size!r} must be an integer >= 1, e.g. chunk_size=64")
        model_device = next(model.parameters()).device
        self.device = torch.device(device) if device is not None else model_device
        if model_device != self.device:
            model.to(self.device)
        self.model = model
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.chunk_size = chunk_size
        self._eos = torch.tensor(self.eos_token_ids, device=self.device)

    # ------------------------------------------------------------------ protocol
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> RolloutResult:
        """Sample ``params.n`` responses per prompt; samples are prompt-major (see RolloutResult).

        Runs in eval mode under ``torch.inference_mode`` and restores the model's training mode afterwards.
        """
        validate_prompts(prompt_ids)
        generator = self._make_generator(params.seed)
        result = RolloutResult()
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                for start in range(0, len(prompt_ids), self.chunk_size):
                    chunk = prompt_ids[start : start + self.chunk_size]
                    result.extend(self._generate_chunk(chunk, start, params, generator))
        finally:
            self.model.train(was_training)
        return result

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs into the engine's model; names are its ``state_dict`` keys, any subset.

        Tensors are converted to the engine model's dtype and device. A tensor that already is the engine's own
        parameter (the engine shares the trainer's module) is skipped, which makes the call a no-op then.
        """
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    raise ValueError(
                        f"sync_weights got {name!r}, which is not a parameter or buffer of the engine's model; "
                        f"names must be state_dict keys such as {next(iter(targets))!r}"
                    )
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"sync_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's model expects "
                        f"{tuple(target.shape)}"
                    )
                if _same_storage(target, tensor):
                    continue
                target.copy_(tensor)

    # ------------------------------------------------------------------ internals
    def _make_generator(self, seed: int | None) -> torch.Generator:
        """A generator on the engine's device; seed None draws one from the global torch RNG."""
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def _generate_chunk(
        self, chunk: list[list[int]], start: int, params: SamplingParams, generator: torch.Generator
    ) -> RolloutResult:
        """Generate for prompts ``chunk`` (global indices start..start+len-1), each repeated n times."""
        rows = [prompt for prompt in chunk for _ in range(params.n)]
        input_ids, attention_mask = left_pad(rows, self.pad_token_id, self.device)
        decoded = self._decode(input_ids, attention_mask, params, generator)
        tokens, logprobs = decoded.tokens.tolist(), decoded.logprobs.tolist()
        lengths, hit_eos = decoded.lengths.tolist(), decoded.hit_eos.tolist()
        return RolloutResult(
            prompt_index=[start + i for i in range(len(chunk)) for _ in range(params.n)],
            response_ids=[row[:n] for row, n in zip(tokens, lengths)],
            response_logprobs=[row[:n] for row, n in zip(logprobs, lengths)],
            finish_reasons=["eos" if e else "length" for e in hit_eos],
        )

    def _decode(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> _Decoded:
        """Prefill the left-padded batch, then decode one token per step with the KV cache.

        input_ids, attention_mask: [B, L]. Stops after ``max_tokens`` steps or when every row has emitted an eos.
        """
        batch, prompt_len = input_ids.shape
        max_tokens = params.max_tokens
        # One mask buffer for prompt + all possible new tokens; step t uses its first prompt_len + t columns.
        full_mask = torch.ones(batch, prompt_len + max_tokens, dtype=attention_mask.dtype, device=self.device)
        full_mask[:, :prompt_len] = attention_mask
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)  # pads get 0; they are masked anyway
        next_position = position_ids[:, -1:] + 1  # [B, 1]

        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
        cache, logits = out.past_key_values, out.logits[:, -1, :]

        tokens = torch.full((batch, max_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(batch, max_tokens, dtype=torch.float32, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=self.device)
        for step in range(max_tokens):
            token, token_logprob = sample_next_token(logits, params, generator)
            token = token.masked_fill(finished, self.pad_token_id)
            tokens[:, step] = token
            logprobs[:, step] = token_logprob.masked_fill(finished, 0.0)
            lengths += (~finished).long()
            finished |= torch.isin(token, self._eos)
            # One host sync per step; it lets short batches stop early instead of decoding pads to max_tokens.
            if step == max_tokens - 1 or bool(finished.all()):
                break
            out = self.model(
                input_ids=token[:, None],
                attention_mask=full_mask[:, : prompt_len + step + 1],
                position_ids=next_position,
                past_key_values=cache,
                use_cache=True,
            )
            cache, logits = out.past_key_values, out.logits[:, -1, :]
            next_position = next_position + 1
        del cache
        hit_eos = torch.isin(tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1), self._eos)
        return _Decoded(tokens=tokens, logprobs=logprobs, lengths=lengths, hit_eos=hit_eos)


def left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into ``input_ids`` [B, L] int64 and ``attention_mask`` [B, L] int64 (1 = token)."""
    width = max(len(r) for r in rows)
    ids = [[pad_id] * (width - len(r)) + list(r) for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(mask, dtype=torch.long, device=device),
    )


def sample_next_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and return (token [B] int64, its log-prob [B] float32).

    logits: [B, V]. The log-prob is taken under ``log_softmax(logits / temperature)`` before top-k/top-p
    filtering (temperature 1 when greedy), matching what the trainer recomputes from the policy's logits.
    """
    logits = logits.float()
    if params.greedy:
        token = logits.argmax(dim=-1)
        return token, F.log_softmax(logits, dim=-1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    logprobs = F.log_softmax(scaled, dim=-1)
    filtered = filter_top_k_top_p(scaled, params.top_k, params.top_p)
    probs = filtered.softmax(dim=-1)
    # Exponential race (equivalent to multinomial): argmax(p / E), E ~ Exp(1); no host sync, one kernel.
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    token = (probs / race).argmax(dim=-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and then outside the top-p nucleus to -inf. logits: [B, V] float32.

    top_k = -1 and top_p = 1.0 disable each filter. The most likely token always survives.
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``b`` is ``a`` itself or a view of the same memory (copying would be a no-op)."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    )
