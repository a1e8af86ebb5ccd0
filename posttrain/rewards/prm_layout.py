"""A process reward model's input layout (TRL's PRM trainer's), shared by PRM training and PRM scoring.

Free of torch and transformers, so checking stepwise data stays a light import."""

from __future__ import annotations

from collections.abc import Sequence


def stepwise_input(
    tokenizer, prompt: str, steps: Sequence[str], separator: str
) -> tuple[list[int], list[int]]:
    """A PRM's input as TRL's PRM trainer lays it out, and where each step is read: (input ids, the position of each
    step's last separator token). The tokenizer's BOS (when it has one) first, then the prompt, each step and the
    separator encoded on their own without special tokens, the separator after every step. `posttrain rm`
    (rm.kind=prm) trains on this layout and the reward scores with it, so the two cannot drift apart."""

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + encode(prompt)
    separator_ids = encode(separator)
    positions = []
    for step in steps:
        ids += encode(step) + separator_ids
        positions.append(len(ids) - 1)
    return ids, positions
