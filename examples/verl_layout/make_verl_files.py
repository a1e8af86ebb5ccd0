"""The inputs of docs/migrating-from-verl.md's CPU run: parquet files in verl's layout and a tiny model directory.

    python3 make_verl_files.py .

writes ``train.parquet`` and ``test.parquet`` with the columns verl's GSM8K preprocessing writes (``data_source:
openai/gsm8k``, ``prompt`` as a chat list, ``ability``, ``reward_model.ground_truth``, ``extra_info``), filled with
the built-in arithmetic task's questions (their answers written GSM8K's way, ``... #### 42``), and ``tiny/``: the
built-in tiny model with random weights, a plain Hugging Face model directory. Needs pyarrow
(``pip install "posttrain[data]"``).
"""

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.data.tasks.arithmetic import make_arithmetic_splits
from posttrain.models.tiny import create_tiny_model_dir

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def verl_rows(records, split: str) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them (its column set and nesting)."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{r.prompt} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r.ground_truth},
            "extra_info": {
                "split": split,
                "index": i,
                "answer": f"#### {r.ground_truth}",
                "question": r.prompt,
            },
        }
        for i, r in enumerate(records)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="directory to write train.parquet, test.parquet and tiny/ to")
    parser.add_argument("--n-train", type=int, default=256)
    parser.add_argument("--n-test", type=int, default=64)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, test = make_arithmetic_splits(0, args.n_train, args.n_test)
    for name, records in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(verl_rows(records, name)), out / f"{name}.parquet")
    create_tiny_model_dir(out / "tiny")
    print(
        f"wrote {out / 'train.parquet'} ({len(train)} rows), {out / 'test.parquet'} ({len(test)} rows), {out / 'tiny'}"
    )


if __name__ == "__main__":
    main()
