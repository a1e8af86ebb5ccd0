"""The rollout engine interface: token ids in, sampled token ids and their log-probs out.

Engines know nothing about text, chat templates or rewards. The native engine (``posttrain.rollout.native.engine``)
implements this in-process over a Hugging Face model; an engine in another process or one backed by vLLM
implements the same protocol, so the trainer does not change.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

FINISH_REASONS = ("eos", "length", "stop")  # "stop": a stop string or a stop token other than eos


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample responses. Keyword-only; ``max_tokens`` is required.

    n: samples per prompt (>= 1).
    temperature: logits are divided by it before softmax (> 0; use ``greedy=True`` for argmax decoding).
    top_p: nucleus filtering, keep the smallest set of tokens whose probability sum reaches top_p (0 < top_p <= 1).
    top_k: keep the k most likely tokens; -1 disables it.
    max_tokens: maximum number of generated tokens per sample (>= 1), eos included.
    greedy: take the argmax (temperature/top_p/top_k are then ignored for choosing tokens).
    seed: seed of the sampling noise; same seed + same inputs -> same outputs, independently of the global torch
        RNG and of how the prompts are batched. None draws the seed from the global torch RNG (reproducible under
        ``torch.manual_seed``).
    """

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    greedy: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, low=1, hint="e.g. max_tokens=256")
        _check_int("n", self.n, low=1, hint="use n=1 for one sample per prompt")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature={self.temperature!r} must be a number, e.g. temperature=1.0")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature={self.temperature!r} must be > 0; for argmax decoding use greedy=True"
            )
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]; use top_p=1.0 to disable it")
        if self.top_k != -1:
            _check_int("top_k", self.top_k, low=1, hint="use top_k=-1 to disable it")
        if not isinstance(self.greedy, bool):
            raise ValueError(f"greedy={self.greedy!r} must be True or False")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, hint="or seed=None to draw it from the global torch RNG")


def _check_int(name: str, value: object, low: int, hint: str) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an int (not bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}; {hint}")


@dataclass
class RolloutResult:
    """Sampled responses, one entry per sample, ordered prompt-major.

    For prompts P0, P1 and n=2 the samples are [P0s0, P0s1, P1s0, P1s1]: prompt i's n samples are contiguous.

    prompt_index: [S] which prompt (index into the ``prompt_ids`` given to ``generate``) each sample answers.
    response_ids: [S][L_s] generated token ids, without the prompt and without padding; an eos that ended the
        sample is included (it is a sampled action, and the policy must learn its probability too).
    response_logprobs: [S][L_s] log-prob of each sampled token under the temperature-scaled distribution
        ``log_softmax(logits / temperature)`` BEFORE top-p/top-k filtering, i.e. the same quantity the trainer
        recomputes from logits. Greedy sampling reports it at temperature 1.
    finish_reasons: [S] "eos" (stopped on an eos token), "length" (hit ``max_tokens``) or "stop" (a stop string
        or a stop token other than eos: a turn that ended for an agent loop to continue; not truncated).
    trainable_mask: [S][L_s] 1 on tokens the policy sampled, 0 on tokens put into the response by others (a tool's
        output, an environment's reply) that the loss must skip; None (single-turn, the default): all are 1.
        It becomes the batch's ``response_mask``.
    prompt_ids: [S][P_s] each sample's own prompt, where it is not the call's prompt (multi-turn: rendered with
        the tools and the environment's opening messages); None: prompt ``prompt_index[s]`` of the call.
    episodes: [S] multi-turn: each sample's trajectory (``posttrain.agents.trajectory.Trajectory``: messages,
        turns, the environment's rewards, metrics); None for single-turn samples.
    dense_rewards: [S] rewards placed inside the response, as (response token index, value) pairs, whose sum is
        already part of the sample's score (a process reward model's step scores, reward.prm.reduction=dense);
        None: the whole score sits on the last trained token.
    """

    prompt_index: list[int] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    response_logprobs: list[list[float]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    trainable_mask: list[list[int]] | None = None
    prompt_ids: list[list[int]] | None = None
    episodes: list[Any] | None = None
    dense_rewards: list[list[tuple[int, float]]] | None = None

    def __post_init__(self) -> None:
        sizes = {
            len(self.prompt_index),
            len(self.response_ids),
            len(self.response_logprobs),
            len(self.finish_reasons),
        }
        for extra in (self.trainable_mask, self.prompt_ids, self.episodes, self.dense_rewards):
            if extra is not None:
                sizes.add(len(extra))
        if len(sizes) != 1:
            raise ValueError(f"RolloutResult fields have different numbers of samples: {sorted(sizes)}")
        if self.trainable_mask is not None:
            for s, (ids, mask) in enumerate(zip(self.response_ids, self.trainable_mask)):
                if len(mask) != len(ids):
                    raise ValueError(
                        f"sample {s}: trainable_mask has {len(mask)} entries for {len(ids)} tokens"
                    )

    def masks(self) -> list[list[int]]:
        """[S][L_s] the trainable mask of every sample (all ones where the engine gave none)."""
        if self.trainable_mask is not None:
            return self.trainable_mask
        return [[1] * len(r) for r in self.response_ids]

    def subset(self, samples: list[int], prompt_index: list[int] | None = None) -> RolloutResult:
        """The samples at ``samples`` in that order (``prompt_index``: their new prompt indices, else kept)."""
        return RolloutResult(
            prompt_index=list(prompt_index)
            if prompt_index is not None
            else [self.prompt_index[s] for s in samples],
            response_ids=[self.response_ids[s] for s in samples],
            response_logprobs=[self.response_logprobs[s] for s in samples],
            finish_reasons=[self.finish_reasons[s] for s in samples],
            trainable_mask=None if self.trainable_mask is None else [self.trainable_mask[s] for s in samples],
            prompt_ids=None if self.prompt_ids is None else [self.prompt_ids[s] for s in samples],
            episodes=None if self.episodes is None else [self.episodes[s] for s in samples],
            dense_rewards=None if self.dense_rewards is None else [self.dense_rewards[s] for s in samples],
        )

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def response_lengths(self) -> list[int]:
        """[S] number of generated tokens per sample."""
        return [len(r) for r in self.response_ids]

    def extend(self, other: RolloutResult) -> None:
        """Append ``other``'s samples (used to join results of prompt chunks, keeping prompt-major order)."""
        if self.trainable_mask is not None or other.trainable_mask is not None:
            self.trainable_mask = self.masks() + other.masks()
        # per-sample extras: all samples have them or none
        for name in ("prompt_ids", "episodes", "dense_rewards"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if (mine is None) != (theirs is None) and len(self) and len(other):
                raise ValueError(f"cannot join results with and without {name}")
            if mine is not None or theirs is not None:
                setattr(self, name, (mine or []) + (theirs or []))
        self.prompt_index.extend(other.prompt_index)
        self.response_ids.extend(other.response_ids)
        self.response_logprobs.extend(other.response_logprobs)
        self.finish_reasons.extend(other.finish_reasons)


#: ``on_sample(index, sample)``: sample ``index`` of a ``generate`` call has finished; ``sample`` is a one-sample
#: :class:`RolloutResult` (its ``prompt_index`` local to the call) equal to entry ``index`` of the call's result.
SampleCallback = Callable[[int, RolloutResult], None]


def report_samples(result: RolloutResult, on_sample: SampleCallback | None, first: int = 0) -> None:
    """Call ``on_sample`` for each of ``result``'s samples, numbered from ``first`` (an engine that learns of
    its samples' ends all at once, or a chunk of them at a time)."""
    if on_sample is None:
        return
    for s in range(len(result)):
        on_sample(first + s, result.subset([s]))


def takes_on_sample(engine: object) -> bool:
    """Whether ``engine.generate`` accepts ``on_sample`` (an engine written before it existed does not)."""
    try:
        return "on_sample" in inspect.signature(engine.generate).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a builtin or a proxy without a signature
        return False


def generate_reporting(
    engine: RolloutEngine,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    on_sample: SampleCallback | None,
    **extra: Any,
) -> RolloutResult:
    """``engine.generate`` with ``on_sample`` called for every sample: as each finishes where the engine can
    say so, else for all of them when it returns."""
    if on_sample is None:
        return engine.generate(prompt_ids, params, **extra)
    if takes_on_sample(engine):
        return engine.generate(prompt_ids, params, on_sample=on_sample, **extra)
    result = engine.generate(prompt_ids, params, **extra)
    report_samples(result, on_sample)
    return result


@dataclass(frozen=True)
class TurnRequest:
    """One assistant turn of a multi-turn trajectory, for :meth:`TurnEngine.generate_turns`.

    ids: the whole context, token ids: the prompt, then every response token so far (assistant and environment).
    max_tokens: this turn's token limit (>= 1).
    sample_id: the trajectory's global sample id (as in ``RolloutEngine.generate``).
    position: how many response tokens precede this turn. The noise of the token sampled at response index k of
        sample s is a function of (seed, s, ``position`` + k), so a one-turn trajectory (position 0) samples
        exactly what ``generate`` samples, and later turns draw fresh noise.
    session: a key shared by the turns of one trajectory: the engine may keep that context's keys/values after
        the turn and reuse them when the next turn extends the same ids (prefix reuse). Only a hint: a session
        whose cache was evicted is prefilled again. Sessions end at ``sync_weights`` and ``release_memory``.
    """

    ids: list[int]
    max_tokens: int
    sample_id: int
    position: int = 0
    session: int | None = None


@runtime_checkable
class TurnEngine(Protocol):
    """An engine that can run the turns of multi-turn trajectories (``posttrain.agents.driver``)."""

    def generate_turns(self, requests: list[TurnRequest], params: SamplingParams) -> RolloutResult:
        """One sample per request, in request order (``prompt_index[i] == i``); ``params`` gives the sampling
        settings and the seed (its ``n`` and ``max_tokens`` are not used: each request has its own limit).
        Finish reasons as in :class:`RolloutResult` ("eos", "stop" or "length"). ``generation_metrics`` then
        reports ``rollout/prefill_tokens`` (prompt tokens computed) and ``rollout/prefill_reused_tokens``
        (prompt tokens whose keys/values were reused from the session's earlier turns)."""
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout engine.

    Weight refresh is explicit: after each policy update the trainer calls ``sync_weights`` with the policy's
    (name, tensor) pairs, named like the Hugging Face model's ``state_dict`` keys. It is an iterable, not a dict,
    so a trainer can stream weights one tensor (or one layer) at a time and an engine in another process can
    copy each as it arrives; any subset is valid (e.g. only LoRA adapters or only the layers that changed).
    """

    def generate(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        prompt_offset: int = 0,
        on_sample: SampleCallback | None = None,
    ) -> RolloutResult:
        """Sample ``params.n`` responses for each prompt (token ids, no padding); see :class:`RolloutResult`.

        on_sample: called in the calling thread with each sample as soon as it is final (see
        :data:`SampleCallback`), each sample once, before ``generate`` returns, so work on finished samples (their
        rewards) can start while the others are generated. Optional for an engine: callers go through
        :func:`generate_reporting`, which reports every sample at the end for an engine without it.

        prompt_offset: prompt i of this call is global prompt ``prompt_offset + i`` and its sample j has the global
        sample id ``(prompt_offset + i) * n + j``. An engine makes each sample's randomness a function of
        (``params.seed``, global sample id, token index) only, so that a data-parallel rank generating prompts
        [a, b) with ``prompt_offset=a`` gets the samples one process generating all prompts would. Result indices
        (``RolloutResult.prompt_index``) stay local to the call.
        """
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the given (name, tensor) pairs into the engine's copy of the policy; names not given are kept."""
        ...

    def release_memory(self) -> None:
        """Free what the engine holds between rollouts (KV cache, or weights when offloaded) before training.

        No-op by default; an engine sharing a GPU with the trainer (e.g. vLLM sleep mode) frees memory here.
        """
        return None

    def wake_up(self) -> None:
        """Re-acquire what :meth:`release_memory` freed, before the next ``generate``. No-op by default."""
        return None

    def close(self) -> None:
        """Free the engine for good (after the run's last collective). No-op by default."""
        return None

    def sync_metrics(self) -> dict[str, float]:
        """Time and bytes of the last ``sync_weights`` (metric name → value); empty where not measured."""
        return {}

    def generation_metrics(self) -> dict[str, float]:
        """The engine's own numbers about the last ``generate`` (throughput, cache use); empty by default."""
        return {}


def validate_prompts(prompt_ids: list[list[int]]) -> None:
    """Raise ValueError unless ``prompt_ids`` is a non-empty list of non-empty lists of token ids."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty; pass at least one prompt (a list of token ids)")
    for i, prompt in enumerate(prompt_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")
