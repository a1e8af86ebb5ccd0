"""trainer.tune_malloc: freed memory is kept for reuse on CPU (fewer page faults), and nothing else changes."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch

from posttrain.utils.allocator import keep_freed_memory_for_cpu_training

# Allocates and frees a 48 MiB tensor (above glibc's largest mmap threshold) 20 times, as a training step does
# with its activations, and prints the page faults that took.
CHURN = """
import json, resource, sys, torch
from posttrain.utils.allocator import keep_freed_memory_for_cpu_training
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
