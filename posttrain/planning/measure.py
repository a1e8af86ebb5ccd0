"""One tuning trial: real steps of one role at one micro-batch setting, with their peak memory and speed.

What runs is what trains: a synthetic :class:`RolloutBatch` of max-length samples (``build_rollout_batch``), cut
into micro-batches by ``micro_batch_rows`` and pushed through ``accumulate_and_step`` with the trainer's own
``actor_loss_fn`` / ``critic_loss_fn`` (update roles), or through ``forward_in_micro_batches`` with
``policy_logprobs`` / ``critic_values`` (forward-only roles), with the forward options and module preparation that
``posttrain.models.prepare`` builds from the config (and LoRA adapters when ``model.lora_rank > 0``). Weights
are random: memory and speed do not depend on their values, and nothing is loaded from disk.

Memory (bytes):

* CUDA: ``torch.cuda.max_memory_allocated`` (``peak_bytes``); ``step_bytes`` is its growth over the allocation
  after setup (model, optimizer states, a one-token warm-up step).
* CPU: resident set size (RSS), because that is what runs out. RSS never shrinks inside a process, so every trial
  runs in a fresh child process (:func:`run_trial_in_subprocess`). The child fixes glibc's mmap threshold
  (``MALLOC_MMAP_THRESHOLD_``) so that large tensors are returned to the system when freed, records RSS before
  building the model, builds it, runs the warm-up step (allocates AdamW's states), records RSS again (the
  *post-setup baseline*), resets the kernel's high-water mark (``/proc/self/clear_refs``) and runs the timed
  steps. ``step_bytes`` = high-water mark - baseline (gradients + activations + logits of the step);
  ``peak_bytes`` = high-water mark - RSS before the model (training state + step). A watchdog thread stops the
  child when RSS passes the memory cap: on CPU exceeding the cap is the out-of-memory condition.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from posttrain.algorithms.aggregation import LossNormalizer
from posttrain.batching.micro import micro_batch_rows
from posttrain.config.load import build_config
from posttrain.data.batch import build_rollout_batch
from posttrain.forward.options import attn_implementation, pass_options
from posttrain.forward.passes import critic_values, policy_logprobs
from posttrain.models.critic import CriticModel
from posttrain.models.hf import resolve_dtype
from posttrain.models.lora import apply_lora
from posttrain.models.prepare import prepare_critic, prepare_policy
from posttrain.train.losses import actor_loss_fn, critic_loss_fn
from posttrain.train.trainable import Trainable
from posttrain.train.update import accumulate_and_step, forward_in_micro_batches

UPDATE_ROLES = ("actor", "critic")
FORWARD_ROLES = ("old_log_prob", "values")
ROLES = UPDATE_ROLES + FORWARD_ROLES
_OOM_EXIT = 3
# Allocations above this size are mmap'd and unmapped on free, so RSS follows live tensors (see module doc).
MMAP_THRESHOLD_BYTES = 1 << 16


@dataclass(frozen=True)
class TrialSpec:
    """One measured setting. Lengths in tokens; ``rows`` samples make one step (one mini-batch on one rank)."""

    role: str  # one of ROLES
    model_config: dict  # a Hugging Face config as a dict (``config.to_dict()``): the architecture
    overrides: tuple[str, ...] = ()  # posttrain config overrides (dtype, checkpointing, chunking, packing)
    prompt_len: int = 64
    response_len: int = 64
    rows: int = 8
    micro_batch_size: int | None = 8  # samples per micro-batch, or None with a token budget
    max_tokens: int | None = None  # token budget per micro-batch (use_dynamic_bsz)
    repeats: int = 2  # timed steps; the fastest is reported (the first pays one-time allocator costs)
    device: str = "cpu"
    threads: int = 1
    memory_cap_bytes: int | None = None  # CPU: the watchdog stops the child above this RSS growth
    seed: int = 0


@dataclass
class TrialResult:
    """What one trial measured. ``status``: ok, oom (CUDA OOM or CPU cap exceeded), timeout or error."""

    status: str
    peak_bytes: int | None = None
    step_bytes: int | None = None
    state_bytes: int | None = None
    seconds: float | None = None  # fastest timed step
    tokens: int = 0  # real tokens per step
    error: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{name} not in /proc/self/status")


def _rss() -> int:
    return _status_kib("VmRSS")


def _reset_high_water_mark() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _start_watchdog(limit_rss: int) -> None:
    """Exit with _OOM_EXIT as soon as RSS passes ``limit_rss`` bytes (polls every 10 ms)."""

    def watch() -> None:
        while True:
            if _rss() > limit_rss:
                os._exit(_OOM_EXIT)
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()


def synthetic_batch(rows: int, prompt_len: int, response_len: int, vocab_size: int, seed: int = 0):
    """A RolloutBatch of ``rows`` max-length samples with every field an update reads filled in."""

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (rows, prompt_len + response_len), generator=g).tolist()
    batch = build_rollout_batch(
        [r[:prompt_len] for r in ids], [r[prompt_len:] for r in ids], list(range(rows)), pad_token_id=0
    )
    shape = batch.response_mask.shape
    batch.old_log_probs = torch.full(shape, -1.0)
    batch.ref_log_probs = torch.full(shape, -1.0)
    batch.advantages = torch.randn(shape, generator=g)
    batch.values = torch.zeros(shape)
    batch.returns = torch.randn(shape, generator=g)
    return batch


def _build(spec: TrialSpec, cfg, device):
    """(module, step function over a batch) for the trial's role, exactly as the trainer prepares them."""

    mc = dict(spec.model_config)
    hf_config = AutoConfig.for_model(mc.pop("model_type"), **mc)
    dtype = resolve_dtype(cfg.model.dtype)
    opts = pass_options(cfg, device)
    critic_role = spec.role in ("critic", "values")
    packed = cfg.critic.use_remove_padding if critic_role else cfg.model.use_remove_padding
    attn = attn_implementation(packed, device)
    torch.manual_seed(spec.seed)
    if critic_role:
        backbone = AutoModel.from_config(hf_config, dtype=dtype, attn_implementation=attn).to(device)
        module = CriticModel(backbone, init_std=0.02)
        if spec.role == "critic":
            prepare_critic(module, cfg)
    else:
        module = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=attn).to(device)
        module = apply_lora(module, cfg)  # model.lora_rank > 0: a PeftModel, only the adapters train
        if spec.role == "actor":
            prepare_policy(module, cfg)
    if spec.role in UPDATE_ROLES:
        optim = cfg.actor.optim if spec.role == "actor" else cfg.critic.optim
        trainable = Trainable.create(module, optim, 1000)
        if spec.role == "actor":
            loss_fn = actor_loss_fn(module, cfg.actor, 1.0, opts.actor)
        else:
            loss_fn = critic_loss_fn(module, cfg.critic, opts.critic)
        module.train()

        def step(batch, micro, budget) -> None:
            normalizer = LossNormalizer.from_mask(batch.response_mask, float(batch.response_width))
            rows = micro_batch_rows(batch, micro, budget)
            accumulate_and_step(
                module, trainable.optimizer, None, batch, rows, loss_fn, normalizer, trainable.grad_clip
            )

        return module, step
    module.eval()
    if spec.role == "old_log_prob":

        def fn(mb):
            return policy_logprobs(module, mb, temperature=1.0, options=opts.old_log_prob)[0]
    else:

        def fn(mb):
            return critic_values(module, mb, opts.critic)

    def forward(batch, micro, budget) -> None:
        forward_in_micro_batches(fn, batch, micro, budget, device)

    return module, forward


def run_trial(spec: TrialSpec) -> TrialResult:
    """Run one trial in this process (use :func:`run_trial_in_subprocess` for CPU memory numbers)."""

    if spec.role not in ROLES:
        raise ValueError(f"trial role {spec.role!r} is not one of {', '.join(ROLES)}")
    torch.set_num_threads(spec.threads)
    device = torch.device(spec.device)
    cuda = device.type == "cuda"
    cfg = build_config(overrides=list(spec.overrides))
    start = _rss() if not cuda else 0
    if spec.memory_cap_bytes and not cuda:
        _start_watchdog(start + spec.memory_cap_bytes)
    try:
        module, step = _build(spec, cfg, device)
        vocab = spec.model_config["vocab_size"]
        step(synthetic_batch(1, 1, 1, vocab, spec.seed).to("cpu"), 1, None)  # allocates optimizer states
        batch = synthetic_batch(spec.rows, spec.prompt_len, spec.response_len, vocab, spec.seed)
        tokens = int(batch.attention_mask.sum())
        if cuda:
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            gc.collect()
            baseline = _rss()
            reset = _reset_high_water_mark()
        best = float("inf")
        for _ in range(spec.repeats):
            t0 = time.perf_counter()
            step(batch, spec.micro_batch_size, spec.max_tokens)
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        if cuda:
            peak = torch.cuda.max_memory_allocated()
            return TrialResult("ok", peak, peak - baseline, baseline, best, tokens)
        hwm = _status_kib("VmHWM")
        return TrialResult(
            "ok", hwm - start, hwm - baseline, baseline - start, best, tokens, extra={"hwm_reset": reset}
        )
    except torch.OutOfMemoryError as err:
        return TrialResult("oom", error=str(err).splitlines()[0])


def run_trial_in_subprocess(spec: TrialSpec, timeout_s: float = 600.0) -> TrialResult:
    """Run one trial in a fresh Python process (fresh RSS, fresh CUDA allocator) and return its result."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(spec.threads),
        MKL_NUM_THREADS=str(spec.threads),
        TOKENIZERS_PARALLELISM="false",
        MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_BYTES),
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "posttrain.planning.measure"],
            input=json.dumps(dataclasses.asdict(spec)),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return TrialResult("timeout", error=f"trial ran past {timeout_s:.0f} s")
    if proc.returncode == _OOM_EXIT:
        return TrialResult("oom", error="RSS passed the memory cap")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        # A killed child (the kernel's OOM killer: -9) is an out-of-memory too.
        status = "oom" if proc.returncode in (-9, 137) else "error"
        return TrialResult(status, error=(proc.stderr.strip().splitlines() or ["no output"])[-1])
    data = json.loads(lines[-1])
    return TrialResult(**data)


def _main() -> None:
    data = json.loads(sys.stdin.read())
    data["overrides"] = tuple(data["overrides"])
    result = run_trial(TrialSpec(**data))
    print(json.dumps(dataclasses.asdict(result)), flush=True)


if __name__ == "__main__":
    _main()
