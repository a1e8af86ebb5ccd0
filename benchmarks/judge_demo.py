"""The judge demonstration: GRPO on a judge's score alone teaches the untrained built-in model a format that no
rule of the task checks (answer in digits only), and a check that never asks the judge rises with the score.

Run: ``OMP_NUM_THREADS=1 python benchmarks/judge_demo.py`` (docs/judges.md has the measured figures).

1. A scripted judge starts: a real HTTP server on 127.0.0.1 that answers OpenAI chat completions. It reads the
   response between the fence whose id the system message announces (posttrain.rewards.judge.rubric.fence)
   and answers ``VERDICT: <0-10>``: ten times the share of the response's non-blank characters that are
   digits, rounded. The untrained ``builtin:base`` writes near-random tokens, a few of them digits, so the
   scores differ within a group and GRPO has a signal.
2. `posttrain train` (through ``posttrain.cli.main``, printed as it is run) on the arithmetic task with
   ``reward.judge.*`` pointing at it and ``reward.rule_weight=0``: trained on the judge alone. The rule still
   runs and is logged (``reward/rule_accuracy``).
3. The independent check: the script reads the held-out generations that every validation writes to
   ``<run-dir>/run/samples.jsonl`` (sampled at the rollout temperature, ``rollout.val_greedy=false``: the greedy text of
   a near-random model is one token repeated, all or nothing) and measures, in plain Python on the decoded text, the share of responses that
   are digits only and the mean share of digit characters. The table shows the judge's score (on the
   training samples) beside it; ``<run-dir>/judge_demo.png`` draws both.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.cli import main as posttrain  # noqa: E402
from posttrain.utils.metrics import read_metrics  # noqa: E402

RUBRIC = """\
system: You grade the format of answers to arithmetic questions.
criteria:
  - name: digits_only
    template: |
      Question: {prompt}
      {response}
      The answer must be written in digits only: no letters, words or symbols.
      Rate 0 (no digit) to 10 (digits only). End with one line: VERDICT: <0-10>.
"""


def digit_share(text: str) -> float:
    """The share of the text's non-blank characters that are digits (0 for a blank text)."""
    chars = [c for c in text if not c.isspace()]
    return sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0


def digits_only(text: str) -> bool:
    return re.fullmatch(r"\s*[0-9]+\s*", text) is not None


def fenced(messages: list[dict]) -> str | None:
    """The response as a careful judge reads it: between the tags whose id the system message announces."""
    announced = re.search(r'<response id="([0-9a-f]+)">', messages[0]["content"])
    if announced is None:
        return None
    user, tag = messages[-1]["content"], announced.group(1)
    opener, closer = f'<response id="{tag}">\n', f'\n</response id="{tag}">'
    start, end = user.find(opener), user.rfind(closer)
    return user[start + len(opener) : end] if 0 <= start < end else None


class Handler(BaseHTTPRequestHandler):
    """POST <base>/chat/completions: a chat completion whose text ends with the verdict."""

    def do_POST(self) -> None:  # noqa: N802 (the http.server name)
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        response = fenced(request["messages"])
        verdict = "none" if response is None else str(round(10 * digit_share(response)))
        completion = {
            "id": "chatcmpl-demo",
            "object": "chat.completion",
            "model": request.get("model", ""),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"Format checked.\nVERDICT: {verdict}"},
                    "finish_reason": "stop",
                }
            ],
        }
        body = json.dumps(completion).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:  # one line per request would drown the run's own output
        pass


def start_judge() -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def train(args, run_dir: Path, base_url: str) -> float:
    rubric = run_dir / "rubric.yaml"
    rubric.write_text(RUBRIC)
    argv = [
        "train",
        "model.path=builtin:base",
        f"trainer.run_dir={run_dir / 'run'}",
        f"trainer.total_steps={args.steps}",
        f"trainer.test_freq={args.test_freq}",
        "trainer.loggers=[jsonl]",
        "trainer.export_hf=false",
        "rollout.val_greedy=false",  # sampled as in training: greedy text of a near-random model is one token repeated
        f"actor.optim.lr={args.lr}",
        "reward.rule_weight=0",
        "reward.judge.enable=true",
        f"reward.judge.base_url={base_url}",
        "reward.judge.model=scripted-format-judge",
        f"reward.judge.rubric={rubric}",
    ]
    print("$ posttrain " + " ".join(argv), flush=True)
    began = time.monotonic()
    code = posttrain(argv)
    if code:
        raise SystemExit(f"posttrain train exited with code {code}")
    return time.monotonic() - began


def independent_check(samples: Path) -> dict[int, tuple[float, float]]:
    """Per validation step: (share of held-out responses in digits only, mean digit share), from the text."""
    by_step: dict[int, list[str]] = {}
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], []).append(row["response"])
    return {
        step: (
            sum(map(digits_only, texts)) / len(texts),
            sum(map(digit_share, texts)) / len(texts),
        )
        for step, texts in sorted(by_step.items())
    }


def table(rows: list[dict], check: dict[int, tuple[float, float]]) -> list[tuple]:
    """(step, judge score, rule accuracy on training samples, val digits-only share, val digit share, val
    rule accuracy); NaN where the step has no such number."""
    nan = float("nan")
    by_step = {r["step"]: r for r in rows}
    out = []
    for step in sorted(set(by_step) | set(check)):
        r = by_step.get(step, {})
        only, share = check.get(step, (nan, nan))
        out.append(
            (
                step,
                r.get("reward/judge/score_mean", nan),
                r.get("reward/rule_accuracy", nan),
                only,
                share,
                r.get("val/accuracy", nan),
            )
        )
    return out


def print_table(lines: list[tuple]) -> None:
    print(
        f"{'step':>5} {'judge score':>12} {'rule acc':>9} {'val digits-only':>16} {'val digit share':>16} {'val acc':>8}"
    )
    for step, judge, rule, only, share, val in lines:
        print(f"{step:>5} {judge:>12.3f} {rule:>9.3f} {only:>16.3f} {share:>16.3f} {val:>8.3f}")


def plot(lines: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    trained = [x for x in lines if x[1] == x[1]]
    ax.plot([x[0] for x in trained], [x[1] for x in trained], label="judge score (training samples)")
    val = [x for x in lines if x[3] == x[3]]
    ax.plot([x[0] for x in val], [x[3] for x in val], "o-", label="held-out: digits only (plain Python)")
    ax.plot([x[0] for x in val], [x[4] for x in val], "s--", label="held-out: digit share (plain Python)")
    ax.set(title="GRPO on a judge alone: answer in digits only", xlabel="GRPO step", ylim=(0, 1.02))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"curves: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="GRPO steps")
    ap.add_argument(
        "--test-freq", type=int, default=10, help="validation every N steps (and before training)"
    )
    ap.add_argument("--lr", type=float, default=2e-4, help="actor.optim.lr")
    ap.add_argument("--run-dir", default="", help="default: a temporary directory")
    ap.add_argument("--no-plot", action="store_true", help="skip the png (matplotlib)")
    args = ap.parse_args()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="judge_demo_"))
    run_dir.mkdir(parents=True, exist_ok=True)
    server, base_url = start_judge()
    try:
        seconds = train(args, run_dir, base_url)
    finally:
        server.shutdown()
        server.server_close()
    lines = table(
        read_metrics(run_dir / "run" / "metrics.jsonl"), independent_check(run_dir / "run" / "samples.jsonl")
    )
    print_table(lines)
    print(f"{args.steps} GRPO steps in {seconds:.0f} s (model load and validations included)")
    if not args.no_plot:
        plot(lines, run_dir / "judge_demo.png")


if __name__ == "__main__":
    main()
