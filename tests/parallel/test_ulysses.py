"""Ulysses sequence parallelism: SP=2 over two gloo processes gives the numbers of one process (SP=1).

One spawn for the module: both ranks run every scenario (padded and packed rows, ragged lengths that do not
divide by 2, KV heads split or replicated, chunked head, activation checkpointing, critic values) and compare
with the single-process result computed in the same process from an identical model: per-token outputs, the
loss, and every parameter's gradient after summing over the SP group (what the data-parallel reduction does
with each rank's loss scaled by the number of ranks). Rank 0 writes the errors; one test per scenario reads them.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from posttrain.data.batch import build_rollout_batch
from posttrain.forward.passes import ForwardOptions, critic_values, policy_logprobs
from posttrain.models.critic import CriticModel
from posttrain.models.prepare import enable_gradient_checkpointing
from posttrain.parallel import ulysses
from posttrain.parallel.rendezvous import local_rendezvous
from tests.parallel.conftest import free_port

TOL = 1e-5

# name -> settings. Lengths: prompt/response lengths per sample (prompt width + response width is odd, so the
# sequence is padded to a multiple of 2; packed rows are ragged too).
SCENARIOS: dict[str, dict] = {
    "padded": {"kv_heads": 2, "remove_padding": False},
    "packed": {"kv_heads": 2, "remove_padding": True},
    "padded_kv_replicated": {"kv_heads": 1, "remove_padding": False},
    "packed_kv_replicated": {"kv_heads": 1, "remove_padding": True},
    "packed_chunked_head": {"kv_heads": 2, "remove_padding": True, "chunk": 5},
    "padded_checkpointing": {"kv_heads": 1, "remove_padding": False, "checkpointing": True},
    "packed_checkpointing_chunked": {
        "kv_heads": 2,
        "remove_padding": True,
        "checkpointing": True,
        "chunk": 4,
    },
    # Long prompts, short responses: every response prediction sits on rank 1; rank 0 still runs backward.
    "padded_responses_on_one_rank": {"kv_heads": 2, "remove_padding": False, "lengths": ([12, 10], [2, 1])},
    "packed_responses_on_one_rank": {
        "kv_heads": 2,
        "remove_padding": True,
        "chunk": 3,
        "lengths": ([12, 10], [2, 1]),
    },
    "critic_padded": {"kv_heads": 2, "remove_padding": False, "critic": True},
    "critic_packed": {"kv_heads": 1, "remove_padding": True, "critic": True},
    "no_grad_packed": {"kv_heads": 2, "remove_padding": True, "no_grad": True},
}
# Padded: prompt width 9 + response width 6 = 15 columns. Packed (rows of <= 16 tokens): sequences of 7, 10,
# 6 and 13 tokens in rows [7 + 6], [13], [10], 13 columns; several sequences in a row, and odd lengths.
DEFAULT_LENGTHS = ([5, 9, 2, 7], [2, 1, 4, 6])


VOCAB, PAD_ID = 96, 0


def _tiny_model(kv_heads: int):
    """The tiny Qwen2 of the test suite (4 query heads) with ``kv_heads`` KV heads and a small vocabulary.

    Built from a config rather than :func:`posttrain.models.tiny.build_tiny_model`: training its tokenizer
    takes seconds per process, and only token ids are needed here.
    """
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=128,
        pad_token_id=PAD_ID,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()


def _batch(lengths):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths[0]]
    responses = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths[1]]
    return build_rollout_batch(prompts, responses, list(range(len(prompts))), PAD_ID)


def _run(model, batch, spec: dict, options):
    """Per-token outputs [B, R] and the loss of one scenario."""
    mask = batch.response_mask
    g = torch.Generator().manual_seed(2)
    target = torch.randn(mask.shape, generator=g)
    if spec.get("critic"):
        values = critic_values(model, batch, options)
        loss = (((values - target) ** 2) * mask).sum() / mask.sum()
        return {"values": values * mask}, loss
    logprobs, entropy = policy_logprobs(model, batch, temperature=0.7, with_entropy=True, options=options)
    loss = (-(logprobs * target) * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
    return {"logprobs": logprobs * mask, "entropy": entropy * mask}, loss


def _build(spec: dict):
    model = _tiny_model(spec["kv_heads"])
    if spec.get("critic"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            model = CriticModel(model.model, init_std=0.1)
    if spec.get("checkpointing"):
        model.train()  # checkpointing is active in training mode only (no dropout in this config)
        enable_gradient_checkpointing(model)
    return model


def _scenario(spec: dict, group) -> dict[str, float]:
    lengths = spec.get("lengths", DEFAULT_LENGTHS)
    batch = _batch(lengths)
    base = ForwardOptions(
        remove_padding=spec["remove_padding"],
        max_row_tokens=16,
        logprob_chunk_size=spec.get("chunk"),
        chunk_checkpoint=spec.get("chunk") is not None,
    )
    sp_options = dataclasses.replace(base, sp_group=group)
    model = _build(spec)
    params = dict(model.named_parameters())
    errors: dict[str, float] = {}
    with torch.set_grad_enabled(not spec.get("no_grad")):
        ref_out, ref_loss = _run(model, batch, spec, base)
        if not spec.get("no_grad"):
            ref_loss.backward()
            ref_grads = {k: p.grad.clone() for k, p in params.items() if p.grad is not None}
            model.zero_grad(set_to_none=True)
        sp_out, sp_loss = _run(model, batch, spec, sp_options)
        if not spec.get("no_grad"):
            sp_loss.backward()
    for key, ref in ref_out.items():
        errors[key] = float((sp_out[key] - ref).abs().max())
    errors["loss"] = float((sp_loss - ref_loss).abs())
    if not spec.get("no_grad"):
        worst = 0.0
        for key, p in params.items():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=group)  # the SP ranks' gradients sum to the full gradient
            ref = ref_grads.get(key, torch.zeros_like(p))
            worst = max(worst, float((grad - ref).abs().max()))
        errors["grads"] = worst
        errors["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
    return errors


def _collectives(group) -> dict[str, float]:
    """all_to_all and gather_sequence against their definitions, forward and backward."""
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(2, 4, 3, 5, generator=g, requires_grad=True)  # [b, heads, local seq, d]
    y = ulysses.all_to_all(x, group, scatter_dim=1, gather_dim=2)  # [b, heads/2, seq, d]
    everyone = [torch.empty_like(x) for _ in range(2)]
    dist.all_gather(everyone, x.detach(), group=group)
    expected = torch.cat([xj[:, 2 * rank : 2 * rank + 2] for xj in everyone], dim=2)
    z = torch.randn(x.shape, generator=g)
    # y = P x for a permutation P across ranks, so d/dx sum(y * P z) = P^T P z = z.
    (y * ulysses.all_to_all(z, group, 1, 2)).sum().backward()
    out = {"a2a_forward": float((y - expected).abs().max()), "a2a_backward": float((x.grad - z).abs().max())}
    h = torch.randn(3, 4, generator=g, requires_grad=True)
    full = ulysses.gather_sequence(h, group, dim=1)  # [3, 8]
    parts = [torch.empty_like(h) for _ in range(2)]
    dist.all_gather(parts, h.detach(), group=group)
    c = torch.arange(24.0).view(3, 8)
    (full * c).sum().backward()
    out["gather_forward"] = float((full - torch.cat(parts, dim=1)).abs().max())
    out["gather_backward"] = float((h.grad - c[:, 4 * rank : 4 * rank + 4]).abs().max())
    return out


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group("gloo", timeout=timeout, **local_rendezvous(rank, world, timeout))  # on loopback
    try:
        group = ulysses.new_sequence_parallel_group(world)
        results = {"collectives": _collectives(group)}
        for name, spec in SCENARIOS.items():
            results[name] = _scenario(spec, group)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
        dist.barrier()  # tear down together: gloo aborts a rank whose peer is still mid-exchange
    finally:
        dist.destroy_process_group()


def _launch(out_path: str) -> None:
    """Two ranks, forked: the children inherit the imported torch/transformers (spawned children spent ~10 s
    importing them again on two busy cores; the scenarios themselves take ~1.5 s). The parent has created no
    process group, and one intra-op thread (conftest) leaves no OpenMP pool to break across the fork."""
    mp.start_processes(_worker, args=(2, free_port(), out_path), nprocs=2, join=True, start_method="fork")


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ulysses") / "results.json"
    _launch(str(out))
    return json.loads(out.read_text())


@pytest.mark.dist
@pytest.mark.timeout(600)  # the first test also starts the ranks (the module fixture)
def test_collectives_match_their_definitions(sp_results):
    assert all(v < 1e-6 for v in sp_results["collectives"].values()), sp_results["collectives"]


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sp2_equals_single_process(sp_results, name):
    errors = sp_results[name]
    scale = errors.pop("grad_scale", 1.0)
    assert scale > 1e-4 or SCENARIOS[name].get("no_grad"), "gradients too small to compare"
    assert all(v < TOL for v in errors.values()), (name, errors)


# ------------------------------------------------------------------------------------------------------
# Single-process checks
# ------------------------------------------------------------------------------------------------------


def test_pad_to_multiple():
    x = torch.arange(5).view(1, 5)
    assert ulysses.pad_to_multiple(x, 2, value=-1).tolist() == [[0, 1, 2, 3, 4, -1]]
    assert ulysses.pad_to_multiple(x, 5) is x


def test_supported_configs():
    from types import SimpleNamespace

    def cfg(heads=4, kv=2, impl="sdpa", layer_types=None):
        return SimpleNamespace(
            num_attention_heads=heads,
            num_key_value_heads=kv,
            _attn_implementation=impl,
            layer_types=layer_types,
        )

    ulysses.check_sequence_parallel_supported(cfg(), 2)
    ulysses.check_sequence_parallel_supported(cfg(kv=1), 4)  # KV heads replicated
    ulysses.check_sequence_parallel_supported(cfg(impl="eager"), 1)  # no SP: anything goes
    with pytest.raises(ValueError, match="num_attention_heads=6"):
        ulysses.check_sequence_parallel_supported(cfg(heads=6, kv=6), 4)
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        ulysses.check_sequence_parallel_supported(cfg(heads=12, kv=3), 2)
    with pytest.raises(ValueError, match="attn_implementation"):
        ulysses.check_sequence_parallel_supported(cfg(impl="eager"), 2)
    with pytest.raises(ValueError, match="sliding"):
        ulysses.check_sequence_parallel_supported(cfg(layer_types=["full_attention", "sliding_attention"]), 2)


def test_installed_wrapper_is_a_pass_through():
    """Without the ``ulysses`` keyword the wrapped sdpa gives bit-identical log-probs and gradients."""
    model = _tiny_model(2)
    batch = _batch(DEFAULT_LENGTHS)

    def run():
        model.zero_grad(set_to_none=True)
        out = [
            policy_logprobs(model, batch, options=ForwardOptions(remove_padding=rp))[0]
            for rp in (False, True)
        ]
        sum(o.sum() for o in out).backward()
        return out, [p.grad.clone() for p in model.parameters()]

    before = run()
    ulysses.install_ulysses_attention()
    ulysses.install_ulysses_attention()  # idempotent: wraps once
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS["sdpa"]._posttrain_ulysses_inner
    assert not hasattr(inner, "_posttrain_ulysses_inner")
    after = run()
    for a, b in zip(before[0] + before[1], after[0] + after[1]):
        assert torch.equal(a, b)


if __name__ == "__main__":  # a manual run: python3 tests/parallel/test_ulysses.py OUT.json
    _launch(sys.argv[1])
    with open(sys.argv[1]) as f:
        print(json.dumps(json.load(f), indent=1))
