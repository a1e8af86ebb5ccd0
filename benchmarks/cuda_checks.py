"""The CUDA paths CI cannot run, checked by hand on a GPU: the figures of docs/rollout.md ("Run once on a GPU") and
docs/throughput.md (the prefix grouper on CUDA).

Run on a machine with a GPU::

    python3 benchmarks/cuda_checks.py                 # tiny Qwen2, random weights; results also in cuda_checks.json
    python3 -m pytest -q -m gpu tests/rl/test_throughput_options.py   # activation offload on CUDA

``--device cpu --shape 2x2x8`` runs the same checks on CPU in a few seconds (a smoke test of the script itself).

Printed, one JSON line per check:

- ``engine``: 8 prompts x 4 greedy samples x 48 tokens on the native engine, eager and with
  ``enforce_eager=false`` (compiled steps, replayed as CUDA graphs on CUDA), fp32 and bf16: whether the tokens
  are the same, seconds of the first and second call, and the largest difference between the engine's log-probs
  and the Hugging Face forward's for the same tokens;
- ``grouper``: two GRPO steps (``--shape``, default 8x8x128) with the prefix grouper and with the padded layout:
  losses, grad norms and rewards per step (equal up to rounding), wall seconds and the peak of GPU memory;
- ``bf16 / graphs``: the same step in bf16 (eager and compiled): wall seconds per step and the phases.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_step_vs_trl import parse_shape, posttrain_config  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from posttrain.models.tiny import create_tiny_model_dir  # noqa: E402
from posttrain.rl.build import build_components  # noqa: E402
from posttrain.rl.step import train_step  # noqa: E402
from posttrain.rollout.base import SamplingParams  # noqa: E402
from posttrain.rollout.native.engine import NativeEngine  # noqa: E402
from posttrain.utils.metrics import PhaseTimer  # noqa: E402
from posttrain.utils.seed import seed_everything  # noqa: E402

METRICS = ("actor/pg_loss", "actor/grad_norm", "reward/mean", "response_length/mean")


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_check(model_dir: Path, device: str) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(f"What is {i} + {i + 3}?")["input_ids"] for i in range(8)]
    params = SamplingParams(max_tokens=48, n=4, greedy=True, seed=1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        runs = {}
        for eager in (True, False):
            engine = NativeEngine(
                model, [tokenizer.eos_token_id], tokenizer.pad_token_id, device=device, enforce_eager=eager
            )
            seconds = []
            for _ in range(2):  # the first call compiles (enforce_eager=false) or warms up
                start = time.perf_counter()
                result = engine.generate(prompts, params)
                synchronize(device)
                seconds.append(round(time.perf_counter() - start, 3))
            runs[eager] = (result, seconds)
        result = runs[True][0]
        ids = torch.tensor([prompts[0] + result.response_ids[0]], device=device)
        with torch.no_grad():
            logits = model(ids).logits.float()[0, len(prompts[0]) - 1 : -1]
        recomputed = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompts[0]) :, None])[:, 0]
        engine_logprobs = torch.tensor(result.response_logprobs[0], device=device)
        out[str(dtype)] = {
            "same tokens eager vs compiled": runs[True][0].response_ids == runs[False][0].response_ids,
            "eager s (1st, 2nd call)": runs[True][1],
            "compiled s (1st, 2nd call)": runs[False][1],
            "max |engine - HF| log-prob": (recomputed - engine_logprobs).abs().max().item(),
        }
    return out


def steps(
    model_dir: Path, shape: tuple[int, int, int], device: str, extra: list[str], count: int = 2
) -> dict:
    """``count`` GRPO steps at ``shape`` with a reward the untrained model varies in (so the gradients are not 0)."""
    prompts, n, tokens = shape
    args = argparse.Namespace(
        prompts=prompts, n=n, max_tokens=tokens, optimizer_steps=1, lr=1e-5, steps=count
    )
    with tempfile.TemporaryDirectory() as run_dir:
        reward = Path(run_dir) / "varied.py"
        reward.write_text(
            "def varied(prompt, response, ground_truth, extra):\n    return float(len(response) % 3)\n"
        )
        overrides = [
            f"trainer.device={device}",
            f"reward.function={reward}:varied",
            "reward.timeout_s=0",
            *extra,
        ]
        cfg = posttrain_config(args, model_dir, Path(run_dir) / "run", overrides)
        seed_everything(0)
        run = build_components(cfg, quiet=True)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timer, rows = PhaseTimer(), []
        for step in range(1, count + 1):
            start = time.perf_counter()
            metrics = train_step(run, step, timer)
            synchronize(device)
            rows.append(
                {"wall s": round(time.perf_counter() - start, 3), **{k: metrics.get(k) for k in METRICS}}
            )
        phases = {k: round(v, 3) for k, v in metrics.items() if k.startswith("timing/")}
        peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
        run.close()
    return {"steps": rows, "last step's phases": phases, "peak MiB": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--shape", type=parse_shape, default=(8, 8, 128), help="PROMPTSxNxTOKENS of the GRPO steps"
    )
    parser.add_argument("--out", default="cuda_checks.json")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run it on a GPU machine, or --device cpu --shape 2x2x8 as a smoke test")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_tiny_model_dir(Path(tmp) / "tiny", seed=0)
        checks = {
            "engine": lambda: engine_check(model_dir, args.device),
            "grouper": lambda: steps(model_dir, args.shape, args.device, []),
            "padded layout": lambda: steps(
                model_dir, args.shape, args.device, ["actor.use_prefix_grouper=false"]
            ),
            "bf16": lambda: steps(model_dir, args.shape, args.device, ["model.dtype=bf16"], count=3),
            "bf16 + graphs": lambda: steps(
                model_dir,
                args.shape,
                args.device,
                ["model.dtype=bf16", "rollout.enforce_eager=false"],
                count=3,
            ),
            "graphs": lambda: steps(model_dir, args.shape, args.device, ["rollout.enforce_eager=false"]),
        }
        for check, run in checks.items():
            results[check] = run()
            print(check, json.dumps(results[check], default=str), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
