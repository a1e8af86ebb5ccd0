"""The data of docs/your-agent-task.md: weather questions, and demonstrations for the SFT warm start.

    python3 make_data.py data

writes data/train.jsonl and data/val.jsonl ({"prompt": "Weather in Oslo?"}: the answer is whatever the tool
reports when it is called, so the rows carry none) and data/demos.jsonl: conversations in the format the rollout
produces (a tool call, the tool's result, the answer). A share of them (--no-tool-rate, half by default) answer
without the tool, with a guess, as written data often does: the warm-started model then knows the tool but does
not prefer it, and RL has something to learn.
"""

import argparse
import json
import random
from pathlib import Path

from weather import CITIES, WEATHERS

from posttrain.agents.hermes import tool_call_text


def demonstration(city: str, rng: random.Random, no_tool_rate: float) -> dict:
    user = {"role": "user", "content": f"Weather in {city}?"}
    if rng.random() < no_tool_rate:
        return {"messages": [user, {"role": "assistant", "content": rng.choice(WEATHERS)}]}
    report = rng.choice(WEATHERS)  # what the tool said in this recorded conversation
    call = {"role": "assistant", "content": tool_call_text("weather", {"city": city})}
    return {
        "messages": [
            user,
            call,
            {"role": "tool", "content": report},
            {"role": "assistant", "content": report},
        ]
    }


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to write train.jsonl, val.jsonl and demos.jsonl to")
    parser.add_argument("--n-demos", type=int, default=960, help="demonstrations to write")
    parser.add_argument(
        "--no-tool-rate", type=float, default=0.5, help="share of demonstrations without the tool"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", 256), ("val", 64)):
        write(out / f"{name}.jsonl", [{"prompt": f"Weather in {CITIES[i % len(CITIES)]}?"} for i in range(n)])
    demos = [demonstration(rng.choice(CITIES), rng, args.no_tool_rate) for _ in range(args.n_demos)]
    write(out / "demos.jsonl", demos)
    print(f"wrote 256 training and 64 validation questions and {len(demos)} demonstrations to {out}")


if __name__ == "__main__":
    main()
