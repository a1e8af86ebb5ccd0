"""In-process rollout over a Hugging Face causal LM: continuous batching over a preallocated slot KV cache.

For Llama/Qwen2-family decoders (``posttrain.rollout.native.decoder``) each prompt is prefilled once (in chunks when it
is long) and its keys/values copied into the slots of its ``n`` samples; every forward then carries one decode
token per running sample plus prefill chunks of waiting prompts, bounded by ``max_num_seqs`` and
``max_num_batched_tokens`` (``posttrain.rollout.native.scheduler``). Finished samples leave at once and waiting prompts
take their slots. Other architectures run a simpler path through the model's own forward: prompts are
left-padded, prefilled once, the cache repeated n times and decoded in lockstep.

Both paths draw tokens with ``posttrain.rollout.native.token_sampling``: a sample's randomness depends only on
(seed, global sample id, token index), so results do not depend on batching, scheduling or how prompts are
split between calls or data-parallel ranks (``prompt_offset``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from posttrain.rollout.base import RolloutEngine, RolloutResult, SamplingParams, validate_prompts
from posttrain.rollout.native.decoder import (
    DecoderParts,
    SlotKVCache,
    build_step_inputs,
    decoder_parts,
    forward_step,
)
from posttrain.rollout.native.graphs import StaticDecoder, bucket
from posttrain.rollout.native.scheduler import Plan, Scheduler
from posttrain.rollout.native.token_sampling import filter_top_k_top_p, sample_tokens

__all__ = ["NativeEngine", "filter_top_k_top_p", "left_pad"]


class NativeEngine(RolloutEngine):
    """Rollout engine running a Hugging Face causal LM in this process.

    model: the policy (an ``AutoModelForCausalLM``-style module, possibly PEFT-wrapped). By default the engine
        uses the module itself (no extra memory; ``sync_weights`` is then a no-op), so the trainer's updates are
        seen at once. With ``own_copy=True`` it keeps a private deep copy, refreshed by ``sync_weights`` (e.g. with
        full state dicts gathered from a sharded trainer). An FSDP2-sharded module cannot be shared: the slot-cache
        path calls the layers' submodules directly, bypassing the hooks that gather a layer's parameters.
    eos_token_ids: a sample finishes when it emits any of these ids.
    pad_token_id: fills the left padding of prompts on the fallback path.
    chunk_size: most prompts in flight at once (admitted and not finished); the fallback path hands the model
        this many prompts at once.
    max_num_seqs: KV-cache slots, i.e. sequences decoding (or being prefilled) at once.
    max_num_batched_tokens: tokens per forward: one per decoding sequence plus prefill chunk tokens.
    enable_chunked_prefill: prefill prompts longer than the remaining token budget in pieces across steps.
    enforce_eager: True runs every step eagerly. False compiles the fixed-shape decode steps with
        ``torch.compile`` and, on CUDA, replays them as CUDA graphs (see ``posttrain.rollout.native.graphs``).
    use_hf_forward: force (True) or forbid (False) the fallback path through the model's own forward; None picks
        the slot-cache path when the architecture is supported.
    device: where to run; defaults to the model's device. The model is moved there if it is elsewhere.
    """

    def __init__(
        self,
        model: nn.Module,
        eos_token_ids: list[int],
        pad_token_id: int,
        chunk_size: int = 64,
        device: str | torch.device | None = None,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 4096,
        enable_chunked_prefill: bool = True,
        enforce_eager: bool = True,
        own_copy: bool = False,
        use_hf_forward: bool | None = None,
    ):
        if len(eos_token_ids) == 0:
            raise ValueError("eos_token_ids is empty; pass at least one id, e.g. [tokenizer.eos_token_id]")
        for name, value in (
            ("chunk_size", chunk_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1, e.g. {name}=64")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} must be >= max_num_seqs={max_num_seqs} (each "
                "decoding sequence needs one token per forward); raise it or lower max_num_seqs"
            )
        model_device = next(model.parameters()).device
        self.device = torch.device(device) if device is not None else model_device
        if own_copy:
            model = copy.deepcopy(model).requires_grad_(False)
        if model_device != self.device or own_copy:
            model.to(self.device)
        self.model = model
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.pad_token_id = int(pad_token_id)
        self.chunk_size = chunk_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = bool(enable_chunked_prefill)
        self.enforce_eager = bool(enforce_eager)
        self._eos = torch.tensor(self.eos_token_ids, device=self.device)
        self.cache = SlotKVCache()
        self._cache_shape: tuple[int, int] | None = None  # (slots, length) to restore on wake_up
        self._static: StaticDecoder | None = None
        reason = decoder_parts(model)
        if use_hf_forward is False and isinstance(reason, str):
            raise ValueError(
                f"use_hf_forward=False but the slot-cache path does not support this model: {reason}"
            )
        self.use_hf_forward = isinstance(reason, str) if use_hf_forward is None else bool(use_hf_forward)

    # ------------------------------------------------------------------ protocol
    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams, prompt_offset: int = 0
    ) -> RolloutResult:
        """Sample ``params.n`` responses per prompt; samples are prompt-major (see RolloutResult).

        prompt_offset: prompt i of this call is global prompt ``prompt_offset + i``; its sample j has global id
        ``(prompt_offset + i) * n + j``, and its randomness depends only on (seed, that id, token index). A
        data-parallel rank generating prompts [a, b) with ``prompt_offset=a`` thus gets the samples a single
        process generating all prompts would (up to float rounding from different batch shapes).
        ``RolloutResult.prompt_index`` stays local to this call. Runs in eval mode under
        ``torch.inference_mode`` and restores the model's training mode afterwards.
        """
        validate_prompts(prompt_ids)
        if isinstance(prompt_offset, bool) or not isinstance(prompt_offset, int) or prompt_offset < 0:
            raise ValueError(
                f"prompt_offset={prompt_offset!r} must be an integer >= 0 (the first prompt's index)"
            )
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                if self.use_hf_forward or self._beyond_window(prompt_ids, params):
                    return self._generate_padded(prompt_ids, params, seed, prompt_offset)
                return self._generate_continuous(prompt_ids, params, seed, prompt_offset)
        finally:
            self.model.train(was_training)

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs into the engine's model; names are its ``state_dict`` keys, any subset.

        Tensors are converted to the engine model's dtype and device. A tensor that already is the engine's own
        parameter (the engine shares the trainer's module) is skipped, which makes the call a no-op then. The KV
        cache holds nothing across calls, so it stays valid (and allocated).
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

    def release_memory(self) -> None:
        """Free the KV cache and any captured decode graphs (e.g. before the trainer's update)."""
        self.cache.release()
        self._static = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Re-allocate the KV cache at the size the last ``generate`` used (no-op if never used)."""
        if self._cache_shape is not None and not self.use_hf_forward:
            parts = self._parts()
            with torch.inference_mode():
                self.cache.ensure(parts, *self._cache_shape)

    # ------------------------------------------------------------------ slot-cache path
    def _parts(self) -> DecoderParts:
        parts = decoder_parts(self.model)
        if isinstance(parts, str):  # the model was changed after construction
            raise ValueError(f"the engine's model is no longer supported by the slot-cache path: {parts}")
        return parts

    def _beyond_window(self, prompt_ids: list[list[int]], params: SamplingParams) -> bool:
        """True when a sliding-window model's window is shorter than this call's context."""
        window = self._parts().max_context
        return window is not None and max(len(p) for p in prompt_ids) + params.max_tokens - 1 > window

    def _generate_continuous(
        self, prompt_ids: list[list[int]], params: SamplingParams, seed: int, prompt_offset: int
    ) -> RolloutResult:
        parts = self._parts()
        sched = Scheduler(
            prompt_ids,
            n=params.n,
            max_tokens=params.max_tokens,
            eos_token_ids=set(self.eos_token_ids),
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill=self.enable_chunked_prefill,
            max_prompts_in_flight=self.chunk_size,
            prompt_offset=prompt_offset,
        )
        # The last sampled token is never fed back, so a sequence uses prompt + max_tokens - 1 positions.
        slots = self._slots_needed(len(prompt_ids), params.n)
        self._cache_shape = (slots, max(len(p) for p in prompt_ids) + params.max_tokens - 1)
        self.cache.ensure(parts, *self._cache_shape)
        while not sched.done:
            plan = sched.schedule()
            logits, rows, sample_ids, steps, finishing = self._step(parts, prompt_ids, plan, sched)
            tokens, logprobs = [], []
            if sample_ids:  # else: only part of a long prompt was prefilled
                if rows is not None:
                    logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
                chosen, chosen_logprobs = sample_tokens(
                    logits,
                    greedy=params.greedy,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    seed=seed,
                    sample_ids=torch.tensor(sample_ids, device=self.device),
                    steps=torch.tensor(steps, device=self.device),
                )
                tokens, logprobs = chosen.tolist(), chosen_logprobs.tolist()  # one host sync per step
            num = len(plan.decode)
            first = {
                prompt: (
                    tokens[num + k * params.n : num + (k + 1) * params.n],
                    logprobs[num + k * params.n : num + (k + 1) * params.n],
                )
                for k, prompt in enumerate(finishing)
            }
            for c in sched.complete(plan, tokens[:num], logprobs[:num], first):
                self.cache.copy_prefix(c.src, c.dst, c.length)
        return _result(sched)

    def _slots_needed(self, prompts: int, n: int) -> int:
        """Cache slots a call can occupy: ``max_num_seqs``, or fewer when the call has fewer samples.

        Why: the cache is allocated (and zeroed) at every wake-up; for a 64-sample rollout of the tiny Qwen2 on
        CPU, 256 slots (51 MB) took 6-20 ms per step to zero and fault in, 64 slots 2 ms. The scheduler hands
        out the lowest free slot first and a call never holds more slots than it has samples (nor than its
        prompts in flight can use), so no slot at or past this count is ever touched. Rounded up to a power of
        two so that the fixed-shape decode path (``graphs.bucket``, capped by the cache's slots) picks the same
        shapes.
        """
        return bucket(min(prompts, self.chunk_size) * n, self.max_num_seqs)

    def _step(self, parts: DecoderParts, prompts: list[list[int]], plan: Plan, sched: Scheduler):
        """Run ``plan``'s forward; return logits and how to read them.

        Returns (logits, rows, sample_ids, steps, finishing): ``rows`` (None = all, in order) picks the logits row
        of each sampled token: one per decode sample, then ``n`` copies of the last-token row of each prompt in
        ``finishing`` (prompts whose prefill ended), whose samples all start from it.
        """
        n = sched.n
        decode = [(s.slot, s.position, s.tokens[-1]) for s in plan.decode]
        sample_ids = [s.sample_id for s in plan.decode]
        steps = [len(s.tokens) for s in plan.decode]
        if not plan.chunks and not self.enforce_eager:
            if self._static is None or self._static.cache_generation != self.cache.generation:
                self._static = StaticDecoder(parts, self.cache)
            return self._static(decode), [s for s, _, _ in decode], sample_ids, steps, []
        prefill, logit_rows, rows, finishing = [], list(range(len(decode))), None, []
        offset = len(decode)
        for chunk in plan.chunks:
            prompt = prompts[chunk.prefill.prompt]
            prefill.append(
                (chunk.prefill.slot, chunk.start, prompt[chunk.start : chunk.start + chunk.length])
            )
            offset += chunk.length
            if chunk.last:
                finishing.append(chunk.prefill.prompt)
                logit_rows.append(offset - 1)
                sample_ids += sched.first_sample_ids(chunk.prefill.prompt)
                steps += [0] * n
        if finishing and n > 1:
            rows = list(range(len(decode))) + [
                len(decode) + k for k in range(len(finishing)) for _ in range(n)
            ]
        whole = len(logit_rows) == offset
        inputs = build_step_inputs(parts, decode, prefill, None if whole else logit_rows, self.device)
        return forward_step(parts, self.cache.k, self.cache.v, inputs), rows, sample_ids, steps, finishing

    # ------------------------------------------------------------------ fallback path
    def _generate_padded(
        self, prompt_ids: list[list[int]], params: SamplingParams, seed: int, prompt_offset: int
    ) -> RolloutResult:
        result = RolloutResult()
        for start in range(0, len(prompt_ids), self.chunk_size):
            chunk = prompt_ids[start : start + self.chunk_size]
            result.extend(self._padded_chunk(chunk, start, params, seed, prompt_offset))
        return result

    def _padded_chunk(
        self, chunk: list[list[int]], start: int, params: SamplingParams, seed: int, prompt_offset: int
    ) -> RolloutResult:
        """Prefill ``chunk`` (local prompts start..) once with the model's forward, repeat the cache n times and
        decode all rows in lockstep until every row finished or ``max_tokens``."""
        n, max_tokens = params.n, params.max_tokens
        logits, cache, full_mask, next_position = self._padded_prefill(chunk, n, max_tokens)
        prompt_len = full_mask.shape[1] - max_tokens
        rows = logits.shape[0]
        first_id = (prompt_offset + start) * n
        sample_ids = torch.arange(first_id, first_id + rows, device=self.device)
        tokens = torch.full((rows, max_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros(rows, max_tokens, dtype=torch.float32, device=self.device)
        lengths = torch.zeros(rows, dtype=torch.long, device=self.device)
        finished = torch.zeros(rows, dtype=torch.bool, device=self.device)
        for step in range(max_tokens):
            token, token_logprob = sample_tokens(
                logits,
                greedy=params.greedy,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                seed=seed,
                sample_ids=sample_ids,
                steps=torch.full_like(sample_ids, step),
            )
            token = token.masked_fill(finished, self.pad_token_id)
            tokens[:, step] = token
            logprobs[:, step] = token_logprob.masked_fill(finished, 0.0)
            lengths += (~finished).long()
            finished |= torch.isin(token, self._eos)
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
        prompt_index = [start + i for i in range(len(chunk)) for _ in range(n)]
        return _lockstep_result(prompt_index, tokens, logprobs, lengths, self._eos)

    def _padded_prefill(
        self, chunk: list[list[int]], n: int, max_tokens: int
    ) -> tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor]:
        """Prefill the left-padded prompts once and repeat the result for their ``n`` samples each.

        Returns ``(logits, cache, full_mask, next_position)``: the last prompt position's logits ``[rows, V]`` and
        the model's KV cache, one row per sample; the attention mask ``[rows, prompt_len + max_tokens]`` (the
        decode columns already 1: every row decodes in lockstep until all finish); each row's next position id.
        """
        input_ids, attention_mask = left_pad(chunk, self.pad_token_id, self.device)
        prompt_len = input_ids.shape[1]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_(min=0)  # pads get 0; they are masked anyway
        out = self.model(
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
        full_mask = torch.ones(rows, prompt_len + max_tokens, dtype=attention_mask.dtype, device=self.device)
        full_mask[:, :prompt_len] = attention_mask.repeat_interleave(n, dim=0)
        next_position = position_ids[:, -1:].repeat_interleave(n, dim=0) + 1
        return logits, cache, full_mask, next_position


def _lockstep_result(
    prompt_index: list[int],
    tokens: torch.Tensor,
    logprobs: torch.Tensor,
    lengths: torch.Tensor,
    eos: torch.Tensor,
) -> RolloutResult:
    """The lockstep decode's ``[rows, max_tokens]`` buffers cut to each row's length; a row that ends on an EOS id
    finished by ``eos``, any other by ``length``."""
    hit_eos = torch.isin(tokens.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1), eos)
    lengths_l, tokens_l, logprobs_l = lengths.tolist(), tokens.tolist(), logprobs.tolist()
    return RolloutResult(
        prompt_index=prompt_index,
        response_ids=[row[:k] for row, k in zip(tokens_l, lengths_l)],
        response_logprobs=[row[:k] for row, k in zip(logprobs_l, lengths_l)],
        finish_reasons=["eos" if e else "length" for e in hit_eos.tolist()],
    )


def _result(sched: Scheduler) -> RolloutResult:
    samples = sched.samples
    return RolloutResult(
        prompt_index=[s.prompt for s in samples],
        response_ids=[s.tokens for s in samples],
        response_logprobs=[s.logprobs for s in samples],
        finish_reasons=[s.finish_reason for s in samples],
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


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``b`` is ``a`` itself or a view of the same memory (copying would be a no-op)."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    )
