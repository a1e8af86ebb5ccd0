"""FSDP2 on a PEFT-wrapped policy, two gloo ranks on CPU: a standalone check for the trainer's coming FSDP2 engine.

Each rank wraps the same tiny Qwen2 with LoRA, applies ``fully_shard`` to every decoder layer and to the root
PeftModel, and trains the adapters on its half of a global batch (token-sum loss over the global token count,
times the world size because FSDP2 averages gradients over ranks). After a few AdamW steps the full adapter
weights (gathered with ``get_model_state_dict(full_state_dict=True)``) must equal one process training on the whole
batch, the frozen base must be unchanged, and the adapters-disabled reference and the merged/adapter weight streams
must work on sharded parameters. What this found is in docs/lora.md ("FSDP2").
"""

import datetime
import os
import warnings

import pytest
import torch

from posttrain.parallel.rendezvous import local_rendezvous
from tests.parallel.conftest import free_port

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::FutureWarning")]

STEPS, LR, ROWS, SEQ, VOCAB = 3, 1e-2, 4, 8, 96


def build_base():
    from transformers import Qwen2ForCausalLM

    from tests.helpers import tiny_qwen2_config

    torch.manual_seed(0)
    config = tiny_qwen2_config(VOCAB)
    return Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")


def build_policy():
    """The same tiny LoRA policy in every process: seeded base, seeded non-zero adapters (B=0 would give A no
    gradient in the first step, and the check would be weaker)."""
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = get_peft_model(build_base(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return policy


def global_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(2))


def token_nll_sum(policy, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token NLL through the root module's forward (FSDP2's hooks run there)."""
    logits = policy(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum"
    )


def train(policy, ids: torch.Tensor, total_tokens: int, scale: float, reduce=None) -> list[float]:
    """AdamW on the adapters; returns the global mean token NLL of each step (``reduce`` sums ranks' shares)."""
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=LR)
    losses = []
    for _ in range(STEPS):
        nll = token_nll_sum(policy, ids)
        (nll / total_tokens * scale).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = nll.detach() / total_tokens
        losses.append(float(reduce(total) if reduce else total))
    return losses


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from posttrain.models.lora import adapter_state, merged_state, reference_policy

    timeout = datetime.timedelta(seconds=300)
    dist.init_process_group("gloo", timeout=timeout, **local_rendezvous(rank, world, timeout))  # on loopback
    try:
        policy = build_policy()
        base_before = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
        for layer in policy.get_base_model().model.layers:
            fully_shard(layer)
        fully_shard(policy)
        params = dict(policy.named_parameters())
        report = {
            "names_kept": set(params) == set(base_before) | {n for n, p in params.items() if p.requires_grad},
            "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
            "trainable": sorted(n for n, p in params.items() if p.requires_grad),
        }
        ids = global_batch()
        share = ids[rank * ROWS // world : (rank + 1) * ROWS // world]
        total = ROWS * (SEQ - 1)

        def all_sum(t):
            dist.all_reduce(t)
            return t

        report["losses"] = train(policy, share, total, scale=world, reduce=all_sum)
        # The reference pass: the same sharded module with adapters disabled (root forward inside the context).
        with torch.no_grad():
            ref = reference_policy(policy)(input_ids=share, use_cache=False).logits
        report["ref_logits"] = ref
        report["requires_grad_restored"] = all(params[n].requires_grad for n in report["trainable"])
        # Weight streams on sharded parameters: every rank walks them (a DTensor is gathered per tensor).
        report["merged"] = {k: v.cpu() for k, v in merged_state(policy, only_adapted=True)}
        report["adapter"] = {k: v.cpu() for k, v in adapter_state(policy)}
        full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            report["full_state"] = full
            report["base_unchanged"] = all(torch.equal(full[n], t) for n, t in base_before.items())
            torch.save(report, os.path.join(out, "rank0.pt"))
        dist.barrier()  # tear down together: gloo aborts a rank whose peer is still mid-exchange
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)
def test_fsdp2_two_ranks_train_the_same_adapters_as_one_process(tmp_path):
    import torch.multiprocessing as mp

    from posttrain.models.lora import adapter_state, merged_state

    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    report = torch.load(tmp_path / "rank0.pt", weights_only=False)

    single = build_policy()
    ids = global_batch()
    losses = train(single, ids, ROWS * (SEQ - 1), scale=1.0)
    trainable = {n: p.detach() for n, p in single.named_parameters() if p.requires_grad}

    assert (
        report["names_kept"] and report["all_dtensor"]
    )  # FQNs unchanged; frozen and trained params both DTensors
    assert report["trainable"] == sorted(trainable)  # mixed requires_grad survives fully_shard
    assert report["base_unchanged"] and report["requires_grad_restored"]
    assert report["losses"] == pytest.approx(losses, rel=1e-5)
    assert losses[-1] < losses[0]
    for name, value in trainable.items():
        torch.testing.assert_close(report["full_state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for name, value in merged_state(single, only_adapted=True):
        torch.testing.assert_close(report["merged"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for name, value in adapter_state(single):
        torch.testing.assert_close(report["adapter"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # the reference of the trained sharded policy is the untouched base model
        base = build_base().eval()(input_ids=ids[: ROWS // 2], use_cache=False).logits
    torch.testing.assert_close(report["ref_logits"], base, rtol=1e-5, atol=1e-5)
