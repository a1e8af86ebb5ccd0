"""Write the word-reversal task of docs/your-task.md: train.jsonl and val.jsonl in the
directory given (default: the current one).

Each row is {"prompt": "Reverse: cab", "answer": "bac"}. Words are 3 letters from "abcgjkmq" (letters
the built-in tokenizer keeps as one token each, so every word is 3 tokens), split at random (fixed seed)
into 400 training and 112 held-out words: validation measures words never trained on.
"""

import itertools
import json
import random
import sys
from pathlib import Path

words = ["".join(t) for t in itertools.product("abcgjkmq", repeat=3)]
random.Random(0).shuffle(words)
here = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
here.mkdir(parents=True, exist_ok=True)
for name, part in (("train", words[:400]), ("val", words[400:])):
    with open(here / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for w in part:
            f.write(json.dumps({"prompt": f"Reverse: {w}", "answer": w[::-1]}) + "\n")
    print(f"{here / name}.jsonl: {len(part)} rows")
