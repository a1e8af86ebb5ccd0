"""In-process rollout over a Hugging Face causal LM: continuous batching over a preallocated slot KV cache.

For Llama/Qwen2-family decoders (``posttrain.rollout.native.decoder``) each prompt is prefilled once (in chunks when it
is long) and its keys/values copied into the slots of its ``n`` samples; every forward then carries one decode
token per running sample plus prefill chunks of waiting prompts, bounded by ``max_num_seqs`` and
``max_num_batched_tokens`` (``posttrain.rollout.native.scheduler``). Finished samples leave at once and waiting prompts
take their slots. Other architectures run a simpler path through the model's own forward
(``posttrain.rollout.native.padded``): prompts are left-padded, prefilled once, the cache repeated n times and
decoded in lockstep.

``generate_turns`` runs the turns of multi-turn trajectories the same way, one sample per request
(``posttrain.rollout.native.turns``); a request's session keeps its slot between turns, so the next turn
prefills only what it adds (``posttrain.rollout.native.sessions``).

Both paths draw tokens with ``posttrain.rollout.native.token_sampling``: a sample's randomness depends only on
(seed, global sample id, token index), so results do not depend on batching, scheduling or how prompts are
split between calls or data-parallel ranks (``prompt_offset``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn

from posttrain.rollout.base import (
    RolloutEngine,
    RolloutResult,
    SampleCallback,
    SamplingParams,
    TurnEngine,
    TurnRequest,
    validate_prompts,
)
from posttrain.rollout.native.decoder import (
    DecoderParts,
    SlotKVCache,
    attention_backends,
    build_step_inputs,
    decoder_parts,
    forward_step,
)
from posttrain.rollout.native.graphs import StaticDecoder, bucket
from posttrain.rollout.native.padded import Lockstep, left_pad, padded_generate, padded_turns
from posttrain.rollout.native.scheduler import Plan, Scheduler
from posttrain.rollout.native.sessions import SessionCache
from posttrain.rollout.native.token_sampling import filter_top_k_top_p, sample_tokens
from posttrain.rollout.native.turns import TurnScheduler

__all__ = ["NativeEngine", "filter_top_k_top_p", "left_pad"]


class NativeEngine(RolloutEngine, TurnEngine):
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
    max_model_len: longest context (prompt + whole response) of a multi-turn trajectory. ``generate_turns``
        allocates the cache this long at once, so that sessions survive from turn to turn; None (or a turn that
        outgrows it) doubles the cache's length when a turn does not fit, which ends the sessions held.
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
        max_model_len: int | None = None,
    ):
        if len(eos_token_ids) == 0:
            raise ValueError("eos_token_ids is empty; pass at least one id, e.g. [tokenizer.eos_token_id]")
        for name, value in (
            ("chunk_size", chunk_size),
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", 1 if max_model_len is None else max_model_len),
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
        self.max_model_len = max_model_len
        self.sessions = SessionCache()  # multi-turn sessions kept in cache slots between turns
        self._metrics: dict[str, float] = {}
        reason = decoder_parts(model)
        if use_hf_forward is False and isinstance(reason, str):
            raise ValueError(
                f"use_hf_forward=False but the slot-cache path does not support this model: {reason}"
            )
        self.use_hf_forward = isinstance(reason, str) if use_hf_forward is None else bool(use_hf_forward)

    # ------------------------------------------------------------------ protocol
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        prompt_offset: int = 0,
        on_sample: SampleCallback | None = None,
    ) -> RolloutResult:
        """Sample ``params.n`` responses per prompt; samples are prompt-major (see RolloutResult).

        prompt_offset: prompt i of this call is global prompt ``prompt_offset + i``; its sample j has global id
        ``(prompt_offset + i) * n + j``, and its randomness depends only on (seed, that id, token index). A
        data-parallel rank generating prompts [a, b) with ``prompt_offset=a`` thus gets the samples a single
        process generating all prompts would (up to float rounding from different batch shapes).
        ``RolloutResult.prompt_index`` stays local to this call. Runs in eval mode under
        ``torch.inference_mode`` and restores the model's training mode afterwards.

        on_sample: called with each sample when it is final: on the slot-cache path when the scheduler retires
        it, on the fallback path when its chunk of prompts is decoded (``RolloutEngine.generate``).
        """
        validate_prompts(prompt_ids)
        if isinstance(prompt_offset, bool) or not isinstance(prompt_offset, int) or prompt_offset < 0:
            raise ValueError(
                f"prompt_offset={prompt_offset!r} must be an integer >= 0 (the first prompt's index)"
            )
        seed = _seed(params)
        self.sessions.clear()  # generate hands out every slot
        self._metrics = {}
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), attention_backends(self.device):
                if self.use_hf_forward or self._beyond_window(prompt_ids, params):
                    lockstep = self._lockstep()
                    return padded_generate(lockstep, prompt_ids, params, seed, prompt_offset, on_sample)
                return self._generate_continuous(prompt_ids, params, seed, prompt_offset, on_sample)
        finally:
            self.model.train(was_training)

    def generate_turns(self, requests: list[TurnRequest], params: SamplingParams) -> RolloutResult:
        """One sample per request, in request order, in one continuous batch (see ``TurnEngine``).

        Requests of different lengths each have their own ``max_tokens``, ``sample_id`` and noise offset
        ``position``: a request at position 0 samples what ``generate([ids], n=1, prompt_offset=sample_id)``
        samples. On the slot-cache path a request's ``session`` keeps its slot after the turn (an evictable
        cached prefix, see ``posttrain.rollout.native.sessions``); the session's next request prefills only what
        its ids add. The fallback path prefills every turn in full. ``params.n`` and ``params.max_tokens`` are
        not used.
        """
        _validate_requests(requests)
        seed = _seed(params)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), attention_backends(self.device):
                longest = max(len(r.ids) + r.max_tokens - 1 for r in requests)
                if self.use_hf_forward or self._exceeds_window(longest):
                    self._metrics = {
                        "rollout/prefill_tokens": float(sum(len(r.ids) for r in requests)),
                        "rollout/prefill_reused_tokens": 0.0,
                    }
                    return padded_turns(self._lockstep(), requests, params, seed)
                return self._turns_continuous(requests, params, seed, longest)
        finally:
            self.model.train(was_training)

    def generation_metrics(self) -> dict[str, float]:
        """After ``generate_turns``: ``rollout/prefill_tokens`` (request tokens computed) and
        ``rollout/prefill_reused_tokens`` (request tokens read from a session's cached prefix)."""
        return dict(self._metrics)

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs into the engine's model; names are its ``state_dict`` keys, any subset.

        Tensors are converted to the engine model's dtype and device. A tensor that already is the engine's own
        parameter (the engine shares the trainer's module) is skipped, which makes the call a no-op then. The KV
        cache stays allocated; the multi-turn sessions it holds end (their keys came from the old weights).
        """
        self.sessions.clear()
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
        """Free the KV cache and any captured decode graphs (e.g. before the trainer's update); sessions end."""
        self.sessions.clear()
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
        return self._exceeds_window(max(len(p) for p in prompt_ids) + params.max_tokens - 1)

    def _exceeds_window(self, longest: int) -> bool:
        """True when a sliding-window model's window is shorter than a ``longest``-token context."""
        window = self._parts().max_context
        return window is not None and longest > window

    def _generate_continuous(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        seed: int,
        prompt_offset: int,
        on_sample: SampleCallback | None = None,
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

        def report(finished: list) -> None:
            for sample in finished:  # a sample's tokens are final once the scheduler retires it
                on_sample(sample.index, _result_of([sample]))

        self._drive(parts, sched, params, seed, report if on_sample is not None else None)
        return _result(sched)

    def _turns_continuous(
        self, requests: list[TurnRequest], params: SamplingParams, seed: int, longest: int
    ) -> RolloutResult:
        """The turns on the slot cache. It is allocated ``max_model_len`` long (or doubled when a turn outgrows it)
        with a slot for every request and every other session held (a power of two, at most ``max_num_seqs``),
        so that a rollout phase's later calls, for the same trajectories, find their sessions."""
        parts = self._parts()
        length = max(longest, self.max_model_len or 0)
        if self.cache.length and length > self.cache.length:
            length = max(length, 2 * self.cache.length)
        self.sessions.sync(self.cache.generation)
        held = self.sessions.count_except({r.session for r in requests})
        self.cache.ensure(parts, bucket(len(requests) + held, self.max_num_seqs), length)
        self._cache_shape = (self.cache.slots, self.cache.length)
        self.sessions.sync(self.cache.generation)
        sched = TurnScheduler(
            requests,
            eos_token_ids=set(self.eos_token_ids),
            num_slots=min(self.cache.slots, self.max_num_seqs),
            max_num_batched_tokens=self.max_num_batched_tokens,
            chunked_prefill=self.enable_chunked_prefill,
            sessions=self.sessions,
        )
        self._drive(parts, sched, params, seed)
        self._metrics = {
            "rollout/prefill_tokens": float(sched.prefill_tokens),
            "rollout/prefill_reused_tokens": float(sched.reused_tokens),
        }
        result = _result(sched)
        result.prompt_index = list(range(len(requests)))
        return result

    def _drive(
        self,
        parts: DecoderParts,
        sched: Scheduler | TurnScheduler,
        params: SamplingParams,
        seed: int,
        report=None,
    ) -> None:
        """Run ``sched``'s steps until every sample finished: forward, sample, record, copy shared prefixes.
        ``report`` (a ``Scheduler``'s run only) gets the samples that finished at each step."""
        n = sched.n
        while not sched.done:
            plan = sched.schedule()
            logits, rows, sample_ids, steps, finishing = self._step(parts, sched.prompts, plan, sched)
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
                    tokens[num + k * n : num + (k + 1) * n],
                    logprobs[num + k * n : num + (k + 1) * n],
                )
                for k, prompt in enumerate(finishing)
            }
            for c in sched.complete(plan, tokens[:num], logprobs[:num], first):
                self.cache.copy_prefix(c.src, c.dst, c.length)
            if report is not None:
                report(sched.take_finished())

    def _lockstep(self) -> Lockstep:
        return Lockstep(self.model, self.device, self.pad_token_id, self._eos, self.chunk_size)

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

    def _step(
        self, parts: DecoderParts, prompts: list[list[int]], plan: Plan, sched: Scheduler | TurnScheduler
    ):
        """Run ``plan``'s forward; return logits and how to read them.

        Returns (logits, rows, sample_ids, steps, finishing): ``rows`` (None = all, in order) picks the logits row
        of each sampled token: one per decode sample, then ``n`` copies of the last-token row of each prompt in
        ``finishing`` (prompts whose prefill ended), whose samples all start from it.
        """
        n = sched.n
        decode = [(s.slot, s.position, s.tokens[-1]) for s in plan.decode]
        sample_ids = [s.sample_id for s in plan.decode]
        steps = [s.step_offset + len(s.tokens) for s in plan.decode]
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
                steps += sched.first_steps(chunk.prefill.prompt)
        if finishing and n > 1:
            rows = list(range(len(decode))) + [
                len(decode) + k for k in range(len(finishing)) for _ in range(n)
            ]
        whole = len(logit_rows) == offset
        inputs = build_step_inputs(parts, decode, prefill, None if whole else logit_rows, self.device)
        return forward_step(parts, self.cache.k, self.cache.v, inputs), rows, sample_ids, steps, finishing


def _result(sched: Scheduler) -> RolloutResult:
    return _result_of(sched.samples)


def _result_of(samples: list) -> RolloutResult:
    return RolloutResult(
        prompt_index=[s.prompt for s in samples],
        response_ids=[s.tokens for s in samples],
        response_logprobs=[s.logprobs for s in samples],
        finish_reasons=[s.finish_reason for s in samples],
    )


def _seed(params: SamplingParams) -> int:
    return params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())


def _validate_requests(requests: list[TurnRequest]) -> None:
    """Raise ValueError unless ``requests`` is a non-empty list of well-formed TurnRequests."""
    if not isinstance(requests, list) or not requests:
        raise ValueError("requests must be a non-empty list of TurnRequest")
    for i, r in enumerate(requests):
        if not isinstance(r, TurnRequest):
            raise ValueError(f"requests[{i}] is a {type(r).__name__}, not a TurnRequest")
        if len(r.ids) == 0:
            raise ValueError(f"requests[{i}].ids is empty; a turn needs at least one token of context")
        for name in ("max_tokens", "sample_id", "position"):
            value, low = getattr(r, name), 1 if name == "max_tokens" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"requests[{i}].{name}={value!r} must be an integer >= {low}")


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``b`` is ``a`` itself or a view of the same memory (copying would be a no-op)."""
    return (
        a.device == b.device
        and a.dtype == b.dtype
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
    )
