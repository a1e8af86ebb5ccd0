"""Batch-invariant token sampling: each sample's randomness is a pure function of (seed, sample id, step).

Why: the same prompts must get the same samples however they are batched — across ``max_num_seqs``, token
budgets, ``chunk_size``, scheduling order, and across data-parallel ranks that each generate a slice of the
prompts (``prompt_offset``). A stateful ``torch.Generator`` cannot give that: the numbers a row draws would depend
on how many rows were drawn before it. Here the noise of token ``v`` for sample ``s`` at response step ``t`` is
``hash(seed, s, t, v)``, computed with a counter-based 64-bit mixer (SplitMix64's finaliser) in int64 torch ops,
so it runs on any device, vectorised, with no host round trip.

A token is drawn with the exponential race (the Gumbel-max trick in another form): with ``p`` the softmax of the
temperature-scaled, top-k/top-p filtered logits and ``E_v`` independent Exp(1) noise, ``argmax_v p_v / E_v`` is an
exact sample from ``p``. Filtered tokens have ``p_v = 0`` and never win.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# SplitMix64 constants as signed int64 (torch has no uint64 arithmetic); wrapping multiplication gives the same
# low 64 bits as the unsigned algorithm.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)
_SEED_MASK = (1 << 63) - 1
_EXPONENT_OF_ONE = (
    0x3FF0000000000000  # float64 bit pattern of 1.0: OR-ing 52 random mantissa bits gives [1, 2)
)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's ``>>`` is arithmetic: it copies the sign bit)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 step on int64 tensors: a bijection of 64-bit words whose output bits look independent."""
    z = z + _GOLDEN
    z.bitwise_xor_(_shr(z, 30)).mul_(_MUL1)
    z.bitwise_xor_(_shr(z, 27)).mul_(_MUL2)
    return z.bitwise_xor_(_shr(z, 31))


def row_keys(seed: int, sample_ids: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[R] int64 key of each (seed, sample id, step) triple; sample_ids, steps: [R] int64."""
    base = mix64(torch.tensor(int(seed) & _SEED_MASK, dtype=torch.int64, device=sample_ids.device))
    return mix64(mix64(base + sample_ids) + steps)


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float64 uniforms in (0, 1), one per (row key, token id), with 52 random mantissa bits.

    The bits are placed in the mantissa of a float in [1, 2) (a bit-level view, far cheaper than an int-to-float
    conversion on CPU), shifted down to [0, 1) and centred on their cell so that neither 0 nor 1 occurs.
    """
    token_ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    z = mix64(keys[:, None] + token_ids[None, :] * _GOLDEN)
    one_to_two = _shr(z, 12).bitwise_or_(_EXPONENT_OF_ONE).view(torch.float64)
    return one_to_two.sub_(1.0 - 2.0**-53)


def exponential_noise(
    seed: int, sample_ids: torch.Tensor, steps: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """[R, V] float32 Exp(1) noise keyed by (seed, sample id, step, token id); sample_ids, steps: [R] int64.

    The logarithm runs in float64 so that the smallest values (the ones that let unlikely tokens win the race)
    keep their full precision; the result is rounded to float32 afterwards, which float32 represents exactly
    enough (relative error 6e-8) down to the smallest value, about 1e-16.
    """
    u = uniform_noise(row_keys(seed, sample_ids, steps), vocab_size)
    return u.log_().neg_().float()


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k and then outside the top-p nucleus to -inf. logits: [B, V] float32.

    top_k = -1 and top_p = 1.0 disable each filter. The most likely token always survives; tokens tied with the
    k-th logit are kept.
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


def sample_tokens(
    logits: torch.Tensor,
    *,
    greedy: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    sample_ids: torch.Tensor,
    steps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens [R] int64, their log-probs [R] float32).

    logits: [R, V]; sample_ids, steps: [R] int64 (global sample id, index of the token in the response).
    The log-prob is taken under ``log_softmax(logits / temperature)`` before top-k/top-p filtering (temperature 1
    when greedy), the same quantity the trainer recomputes from the policy's logits. Greedy takes the argmax
    (first index on ties) and uses no noise.
    """
    logits = logits.float()
    if greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, F.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    scaled = logits / temperature
    filtered = filter_top_k_top_p(scaled, top_k, top_p)
    # Unnormalised probabilities suffice for the race (the argmax ignores a common factor).
    weights = (filtered - filtered.amax(dim=-1, keepdim=True)).exp_()
    race = exponential_noise(seed, sample_ids, steps, logits.shape[-1])
    tokens = (weights / race).argmax(dim=-1)
    chosen = scaled.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, chosen - torch.logsumexp(scaled, dim=-1)
