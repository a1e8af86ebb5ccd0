"""trainer.tune_malloc: freed memory is kept for reuse on CPU (fewer page faults), and nothing else changes."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from posttrain.utils.allocator import keep_freed_memory_for_cpu_training
from tests.helpers import small_overrides

# Allocates and frees a 48 MiB tensor (above glibc's largest mmap threshold) 20 times, as a training step does
# with its activations, and prints the page faults that took.
CHURN = """
import json, resource, sys, torch
from posttrain.utils.allocator import keep_freed_memory_for_cpu_training
from tests.helpers import small_overrides
said = keep_freed_memory_for_cpu_training(sys.argv[1] == "on", torch.device("cpu"))
torch.ones(12 << 20)  # the first allocation faults its pages in either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(12 << 20)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "said": said}))
"""


def _churn(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt"
)
def test_kept_memory_is_reused_without_page_faults():
    off, on = _churn("off"), _churn("on")
    assert off["said"] == "glibc malloc defaults (trainer.tune_malloc=false)"
    assert on["said"] == "freed memory kept for reuse (glibc mallopt)"
    # Without the policy each 48 MiB block is mapped afresh: ~12k faults of 4 KiB pages per allocation.
    assert off["faults"] > 20 * 5000, off
    # With it the block is reused: typically only the loop's first allocation faults (12k). The kernel may still
    # reclaim idle pages of a kept block now and then (seen: up to 7 of the 20), so the bound leaves room.
    assert on["faults"] < off["faults"] / 2, (on, off)


def test_policy_applies_to_cpu_training_only():
    assert (
        keep_freed_memory_for_cpu_training(True, torch.device("cuda"))
        == "glibc malloc defaults (training on cuda)"
    )
    assert keep_freed_memory_for_cpu_training(False, torch.device("cpu")).endswith(
        "(trainer.tune_malloc=false)"
    )


@pytest.mark.long
def test_training_gives_the_same_weights_with_and_without_the_policy(tiny_model_dir, tmp_path):
    """Two steps of `posttrain train` in fresh processes (a reward the untrained model varies in, so the weights
    move): the exported weights are equal bit for bit."""
    weights = {}
    for policy in ("true", "false"):
        run_dir = tmp_path / policy / "run"
        run_dir.parent.mkdir()
        args = small_overrides(tiny_model_dir, run_dir, "trainer.device=cpu", f"trainer.tune_malloc={policy}")
        done = subprocess.run(
            [sys.executable, "-m", "posttrain", "train", *args], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        weights[policy] = load_file(run_dir / "final_model" / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(initial[k], weights["true"][k]) for k in initial)  # it trained
    assert weights["true"].keys() == weights["false"].keys()
    assert all(torch.equal(weights["true"][k], weights["false"][k]) for k in weights["true"])
