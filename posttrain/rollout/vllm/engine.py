"""The vLLM rollout engine: ``RolloutEngine`` over an in-process ``vllm.LLM``.

Token ids in, ``RolloutResult`` out. Every sample is its own vLLM request (n=1) with a seed derived from
(``params.seed``, global sample id), so a sample's randomness does not depend on batching, on how prompts are split
between calls or data-parallel ranks (``prompt_offset``), or on ``max_num_seqs``; vLLM's prefix cache still
prefills a prompt once for its n samples. The turns of multi-turn trajectories (``generate_turns``) are requests
too, seeded by (seed, sample id, position); a turn whose context extends an earlier turn's reuses that turn's
cached keys/values through the same prefix cache. ``vllm`` is imported only when an engine is built.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from posttrain.rollout.base import (
    RolloutEngine,
    RolloutResult,
    SampleCallback,
    SamplingParams,
    TurnRequest,
    validate_prompts,
)
from posttrain.rollout.vllm.knobs import VLLMKnobs, check_vllm_settings, llm_kwargs, require_vllm
from posttrain.rollout.vllm.weight_sync import (
    checkpoint_names,
    plan_buckets,
    reload_on_worker,
)

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit ints that spreads every input bit over the output."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int, sample_id: int) -> int:
    """The vLLM request seed of global sample ``sample_id`` under ``seed``: a 63-bit int (fits int64)."""
    return _mix64((_mix64(seed & _MASK64) + sample_id + 1) & _MASK64) >> 1


def turn_seed(seed: int, sample_id: int, position: int) -> int:
    """The vLLM request seed of the turn of sample ``sample_id`` that starts at response index ``position``.

    Position 0 is :func:`sample_seed` (a one-turn trajectory samples what ``generate`` samples); a later turn gets
    a fresh 63-bit seed from (seed, sample id, position). vLLM draws a request's noise from one generator seeded
    once, so (seed, sample id, position) rather than each token's index picks a turn's noise.
    """
    base = sample_seed(seed, sample_id)
    if position == 0:
        return base
    return _mix64((_mix64(base << 1 | 1) + position) & _MASK64) >> 1


def logprobs_match_trainer(params: SamplingParams) -> bool:
    """True when the engine's log-probs are the trainer's ``log_softmax(logits / temperature)`` at the sampled
    token. vLLM's processed log-probs are renormalised over the tokens top-k/top-p keep, so with either active
    they differ (the trainer should then refuse settings that reuse them, e.g. bypass mode)."""
    return params.greedy or (params.top_k == -1 and params.top_p >= 1.0)


class VLLMEngine(RolloutEngine):
    """Rollout engine backed by vLLM in this process.

    model_dir: Hugging Face model directory (config, tokenizer; weights unless ``knobs.load_format="dummy"``, in
        which case ``generate`` refuses to run until ``sync_weights`` has given every checkpoint tensor once).
    eos_token_ids: a sample finishes when it emits any of these (the model's own eos is ignored, as in the
        native engine, so both engines stop on the same ids).
    dtype: "fp32", "bf16" or "fp16" (``model.dtype``).
    seed: vLLM's engine seed (vLLM also seeds this process's global RNGs with it).
    device: "cpu" or "cuda".
    knobs: see :class:`VLLMKnobs`; checked by :func:`check_vllm_settings` before vLLM loads anything.
    """

    def __init__(
        self,
        model_dir: str | Path,
        eos_token_ids: list[int],
        *,
        dtype: str = "fp32",
        seed: int = 0,
        device: str = "cpu",
        knobs: VLLMKnobs | None = None,
    ):

        if len(eos_token_ids) == 0:
            raise ValueError("eos_token_ids is empty; pass at least one id, e.g. [tokenizer.eos_token_id]")
        self.knobs = knobs or VLLMKnobs()
        self.device = "cuda" if str(device).startswith("cuda") else "cpu"
        self.model_dir = Path(model_dir)
        self.model_config = AutoConfig.from_pretrained(model_dir)
        check_vllm_settings(self.knobs, self.device, dtype, self.model_config)
        # In-process engine core: weights are pushed by reference, callables run in this process.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = require_vllm()
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.llm = vllm.LLM(
            **llm_kwargs(self.knobs, str(model_dir), dtype, seed, self.device, self.model_config)
        )
        self._known = checkpoint_names(model_dir)
        # The config class knows the architecture's default when config.json omits the flag.
        self._tied = bool(getattr(self.model_config.get_text_config(), "tie_word_embeddings", False))
        # With dummy weights, every checkpoint tensor must be pushed once before sampling means anything.
        self._never_synced = set(self._known or ()) if self.knobs.load_format == "dummy" else set()
        self._lora_request: Any = None
        self._lora_id = 0
        self._asleep_tags: list[str] = []  # what vLLM's sleep mode holds released (CUDA only)
        self._sync_metrics: dict[str, float] = {}
        self._gen_stats: dict[str, float] = {}
        self._counters_before: dict[str, float] = {}

    @property
    def needs_full_sync(self) -> bool:
        """True while a dummy-weight engine still lacks some checkpoint tensors (``generate`` refuses to run)."""
        return bool(self._never_synced)

    def logprobs_match_trainer(self, params: SamplingParams) -> bool:
        """Whether ``generate(..., params)`` reports the trainer's log-prob definition; see the module function."""
        return logprobs_match_trainer(params)

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        prompt_offset: int = 0,
        on_sample: SampleCallback | None = None,
    ) -> RolloutResult:
        """Sample ``params.n`` responses per prompt; see :class:`RolloutResult` for the layout.

        Sample j of prompt i has global id ``(prompt_offset + i) * n + j`` and is one vLLM request seeded with
        ``sample_seed(seed, id)``. Log-probs are ``log_softmax(logits / temperature)`` at the sampled token
        (temperature 1 for greedy); with top-k/top-p active vLLM renormalises them after filtering, see
        :func:`logprobs_match_trainer`. ``on_sample`` gets each sample when vLLM's engine reports its request
        finished (:meth:`_run_reporting`).
        """
        validate_prompts(prompt_ids)
        if isinstance(prompt_offset, bool) or not isinstance(prompt_offset, int) or prompt_offset < 0:
            raise ValueError(
                f"prompt_offset={prompt_offset!r} must be an integer >= 0 (the first prompt's index)"
            )
        self._check_ready(prompt_ids, params)
        self.wake_up()  # a no-op unless release_memory put a CUDA engine to sleep
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        prompts, requests = self._requests(prompt_ids, params, seed, prompt_offset)
        self._counters_before = self._read_counters()
        start = time.perf_counter()
        if on_sample is None:
            outputs = self.llm.generate(prompts, requests, use_tqdm=False, lora_request=self._lora_request)
        else:
            outputs = self._run_reporting(prompts, requests, params.n, on_sample)
        elapsed = time.perf_counter() - start
        result = self._result(outputs, params.n)
        self._gen_stats = _stats(outputs, result, elapsed)
        return result

    def _run_reporting(
        self, prompts: list[Any], requests: list[Any], n: int, on_sample: SampleCallback
    ) -> list[Any]:
        """What ``llm.generate`` does (queue the requests, step the engine until none is left), calling
        ``on_sample`` with each request's sample in the step that finishes it; the outputs in request order.
        Requests still queued when something raises are aborted, so the next call starts from an empty engine."""
        ids = self.llm.enqueue(prompts, requests, use_tqdm=False, lora_request=self._lora_request)
        # enqueue returns vLLM's internal ids ("<counter>-<8 random characters>"); outputs carry the counter.
        position = {request_id.rsplit("-", 1)[0]: k for k, request_id in enumerate(ids)}
        outputs: list[Any] = [None] * len(ids)
        engine = self.llm.llm_engine
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        k = position[output.request_id]
                        outputs[k] = output
                        one = self._result([output], 1)
                        one.prompt_index = [k // n]
                        on_sample(k, one)
        except BaseException:
            engine.abort_request([i for i, out in zip(ids, outputs) if out is None], internal=True)
            raise
        return outputs

    def generate_turns(self, requests: list[TurnRequest], params: SamplingParams) -> RolloutResult:
        """One sample per :class:`TurnRequest`, in request order (``prompt_index[i] == i``); see
        :class:`~posttrain.rollout.base.TurnEngine`.

        Each request is one vLLM request with its own ``max_tokens`` and the seed
        ``turn_seed(params.seed, sample_id, position)`` (``params.n`` and ``params.max_tokens`` are not used). A
        request with a ``session`` may read vLLM's prefix cache (the earlier turns' keys/values, or another sample's
        with the same prompt: cached blocks are shared by content); ``session=None`` computes its whole context.
        ``generation_metrics`` then reports the prompt tokens computed and reused.
        """
        _check_turns(requests)
        self._check_ready([r.ids for r in requests], params, max(r.max_tokens for r in requests))
        self.wake_up()
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        common = self._common(params)
        prompts, vparams = [], []
        for r in requests:
            prompts.append(self._tokens_prompt(r.ids))
            request_seed = None if params.greedy else turn_seed(seed, r.sample_id, r.position)
            vparams.append(
                self._vparams(
                    common,
                    seed=request_seed,
                    max_tokens=r.max_tokens,
                    skip_reading_prefix_cache=r.session is None,
                )
            )
        self._counters_before = self._read_counters()
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, vparams, use_tqdm=False, lora_request=self._lora_request)
        elapsed = time.perf_counter() - start
        result = self._result(outputs, 1)
        self._gen_stats = _stats(outputs, result, elapsed)
        return result

    def _check_ready(
        self, prompt_ids: list[list[int]], params: SamplingParams, max_tokens: int | None = None
    ) -> None:
        if self._never_synced:
            raise ValueError(
                f"the vLLM engine was started with rollout.load_format=dummy (random weights) and "
                f"{len(self._never_synced)} checkpoint tensors (e.g. {sorted(self._never_synced)[0]!r}) were never "
                "given to sync_weights; push the policy's full state_dict before the first generate, or use "
                "rollout.load_format=auto"
            )
        longest = max(len(p) for p in prompt_ids)
        max_tokens = params.max_tokens if max_tokens is None else max_tokens
        if longest + max_tokens > self.knobs.max_model_len:
            raise ValueError(
                f"rollout.max_model_len={self.knobs.max_model_len} is shorter than the longest prompt ({longest}) "
                f"+ max_tokens ({max_tokens}); raise rollout.max_model_len (0 = data.max_prompt_length + "
                "data.max_response_length) or shorten prompts"
            )

    def _requests(
        self, prompt_ids: list[list[int]], params: SamplingParams, seed: int, prompt_offset: int
    ) -> tuple[list[Any], list[Any]]:
        """One (TokensPrompt, vllm.SamplingParams) per sample, prompt-major: S = len(prompt_ids) x n of each."""
        common = self._common(params)
        prompts, requests = [], []
        for i, prompt in enumerate(prompt_ids):
            tokens = self._tokens_prompt(prompt)
            for j in range(params.n):
                sample_id = (prompt_offset + i) * params.n + j
                request_seed = None if params.greedy else sample_seed(seed, sample_id)
                prompts.append(tokens)
                requests.append(self._vparams(common, seed=request_seed, max_tokens=params.max_tokens))
        return prompts, requests

    def _common(self, params: SamplingParams) -> dict[str, Any]:
        """The vLLM sampling settings every request of a call shares (all but seed and max_tokens)."""
        common: dict[str, Any] = {
            "n": 1,
            "logprobs": 0,  # the sampled token's log-prob only
            "stop_token_ids": self.eos_token_ids,
            "ignore_eos": True,  # stop on our eos ids only (a stop token id is still returned in token_ids)
            "detokenize": False,
        }
        if params.greedy:
            common["temperature"] = 0.0
        else:
            common.update(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=0 if params.top_k == -1 else params.top_k,
            )
        return common

    @staticmethod
    def _tokens_prompt(ids: list[int]) -> Any:
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=[int(t) for t in ids])

    @staticmethod
    def _vparams(common: dict[str, Any], **per_request: Any) -> Any:
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(**common, **per_request)

    def _result(self, outputs: list[Any], n: int) -> RolloutResult:
        result = RolloutResult()
        eos = set(self.eos_token_ids)
        for k, output in enumerate(outputs):
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            result.prompt_index.append(k // n)
            result.response_ids.append(ids)
            result.response_logprobs.append([lp[t].logprob for lp, t in zip(completion.logprobs, ids)])
            stopped = completion.finish_reason == "stop" and bool(ids) and ids[-1] in eos
            result.finish_reasons.append("eos" if stopped else "length")
        return result

    # ------------------------------------------------------------------ weights
    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors into vLLM's copy of the policy, in buckets of whole fused groups.

        Buckets hold at most ``knobs.bucket_bytes`` (one group larger than that travels alone), one decoder layer
        at most with ``knobs.layered_summon``; each is loaded through the worker's in-place reload
        (``collective_rpc``), then the prefix cache is reset (its keys/values came from the old weights). A group
        with missing members raises ValueError and is not loaded (see ``weight_sync.plan_buckets``). Time and
        bytes are kept for :meth:`sync_metrics`.
        """
        if "weights" in self._asleep_tags:  # weights must be resident to be overwritten (CUDA; not exercised)
            self.llm.wake_up(tags=["weights"])
            self._asleep_tags.remove("weights")
        start, total, buckets = time.perf_counter(), 0, 0
        try:
            for bucket in plan_buckets(
                named_tensors, self.knobs.bucket_bytes, self._tied, self._known, self.knobs.layered_summon
            ):
                self.llm.collective_rpc(reload_on_worker, args=(bucket,))
                total += sum(t.numel() * t.element_size() for _, t in bucket)
                buckets += 1
                self._never_synced.difference_update(name for name, _ in bucket)
        finally:
            if buckets:
                self.llm.reset_prefix_cache()
            self._sync_metrics = {
                "rollout/sync_s": time.perf_counter() - start,
                "rollout/sync_bytes": float(total),
                "rollout/sync_buckets": float(buckets),
            }

    def close(self) -> None:
        """Shut vLLM's in-process engine down now rather than at interpreter exit: its teardown destroys the
        distributed state it set up, the default process group included, so the trainer calls this after its
        last collective (then finds no group left to destroy)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()

    def sync_metrics(self) -> dict[str, float]:
        """Seconds, bytes and buckets of the last ``sync_weights`` / adapter load (empty before the first)."""
        return dict(self._sync_metrics)

    def load_lora_adapter(self, adapter_dir: str | Path) -> None:
        """Serve the PEFT adapter saved in ``adapter_dir`` (``save_pretrained``) from the next ``generate`` on.

        Each load gets a new LoRA id, so vLLM reads the new files instead of reusing its cached adapter; the
        previous adapter is removed from the engine. Needs ``knobs.enable_lora``.
        """
        from vllm.lora.request import LoRARequest

        if not self.knobs.enable_lora:
            raise ValueError(
                "load_lora_adapter needs an engine built with enable_lora=True (adapter-only sync)"
            )
        start = time.perf_counter()
        previous = self._lora_request
        self._lora_id += 1
        self._lora_request = LoRARequest(f"policy-{self._lora_id}", self._lora_id, str(adapter_dir))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.llm.reset_prefix_cache()
        size = sum(f.stat().st_size for f in Path(adapter_dir).glob("*.safetensors"))
        self._sync_metrics = {
            "rollout/sync_s": time.perf_counter() - start,
            "rollout/sync_bytes": float(size),
            "rollout/sync_buckets": 1.0,
        }

    def clear_lora_adapter(self) -> None:
        """Sample from the base weights again (after :meth:`load_lora_adapter`)."""
        if self._lora_request is not None:
            self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
            self._lora_request = None
            self.llm.reset_prefix_cache()

    # ------------------------------------------------------------------ memory
    def release_memory(self) -> None:
        """CUDA with ``free_cache_engine``: vLLM sleep mode level 1 (KV cache dropped, weights offloaded to host
        memory) so the trainer gets the GPU. Otherwise (CPU: vLLM's sleep mode raises there, and a CPU engine
        shares nothing with a GPU trainer) only the prefix cache is emptied, so multi-turn sessions end here as
        the engine interface says. The CUDA path is written against vLLM's public API and is not exercised by
        this project's tests (no GPU)."""
        if self.device == "cuda" and self.knobs.free_cache_engine and not self._asleep_tags:
            self.llm.sleep(level=1)
            self._asleep_tags = ["weights", "kv_cache"]
        elif not self._asleep_tags:
            self.llm.reset_prefix_cache()

    def wake_up(self) -> None:
        """Undo :meth:`release_memory` before the next ``generate``: wake what is still asleep (the weights may
        already be awake after a ``sync_weights``). CUDA only; a CPU no-op; not exercised here."""
        if self._asleep_tags:
            self.llm.wake_up(tags=list(self._asleep_tags))
            self._asleep_tags = []

    # ------------------------------------------------------------------ metrics
    def _read_counters(self) -> dict[str, float]:
        """vLLM's cumulative Prometheus counters and gauges, summed over labels (empty when stats are off)."""
        if self.knobs.disable_log_stats:
            return {}
        values: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            value = getattr(metric, "value", None)
            if isinstance(value, (int, float)):
                values[metric.name] = values.get(metric.name, 0.0) + float(value)
        return values

    def generation_metrics(self) -> dict[str, float]:
        """Numbers of the last ``generate`` or ``generate_turns`` for logging: response tokens/s and prompt tokens
        computed (``rollout/prefill_tokens``) and read from the prefix cache (``rollout/prefill_reused_tokens``,
        vLLM's ``num_cached_tokens``) (always), and with
        ``disable_log_stats=False`` vLLM's own counts (prompt/generated tokens, prefix-cache hit rate,
        preemptions, KV-cache usage at the end)."""
        if not self._gen_stats:
            return {}
        out = {
            "rollout/tokens_per_s": self._gen_stats["tokens"] / max(self._gen_stats["seconds"], 1e-9),
            "rollout/prefill_tokens": self._gen_stats["prefill"],
            "rollout/prefill_reused_tokens": self._gen_stats["reused"],
        }
        if self.knobs.disable_log_stats:
            return out
        now, before = self._read_counters(), self._counters_before

        def delta(name: str) -> float:
            return now.get(name, 0.0) - before.get(name, 0.0)

        prompt = delta("vllm:prompt_tokens")
        out.update(
            {
                "rollout/vllm_prompt_tokens": prompt,
                "rollout/vllm_generation_tokens": delta("vllm:generation_tokens"),
                "rollout/vllm_prefix_cache_hit_rate": delta("vllm:prompt_tokens_cached") / prompt
                if prompt
                else 0.0,
                "rollout/vllm_preemptions": delta("vllm:num_preemptions"),
                "rollout/vllm_kv_cache_usage": now.get("vllm:kv_cache_usage_perc", 0.0),
            }
        )
        return out


def _stats(outputs: list[Any], result: RolloutResult, elapsed: float) -> dict[str, float]:
    """Seconds, response tokens, and prompt tokens computed / reused (vLLM's ``num_cached_tokens``) of a call."""
    total = sum(len(o.prompt_token_ids) for o in outputs)
    reused = sum(max(0, o.num_cached_tokens or 0) for o in outputs)
    return {
        "seconds": elapsed,
        "tokens": float(sum(result.response_lengths)),
        "prefill": float(total - reused),
        "reused": float(reused),
    }


def _check_turns(requests: list[TurnRequest]) -> None:
    """Raise ValueError unless ``requests`` is a non-empty list of turns with contexts and limits >= 1."""
    if not requests:
        raise ValueError("requests is empty; pass at least one TurnRequest")
    validate_prompts([r.ids for r in requests])
    for i, r in enumerate(requests):
        for key in ("max_tokens", "sample_id", "position"):
            value, low = getattr(r, key), 1 if key == "max_tokens" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"requests[{i}].{key}={value!r} must be an integer >= {low}")
