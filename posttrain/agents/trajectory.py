"""A multi-turn trajectory: the token stream after the prompt with its mask, turns, rewards and messages.

Layout (``response_ids``, after the prompt)::

    prompt | assistant 1 (mask 1) | tool/user (mask 0) | assistant 2 (mask 1) | ... | assistant k (mask 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = ("stop", "length", "turn_limit")


@dataclass
class Trajectory:
    """One episode.

    prompt_ids: [P] the rendered prompt (messages, tools, assistant header).
    response_ids: [R] every token after the prompt; ``mask[i]`` is 1 for a sampled assistant id, 0 for an
        environment token; ``logprobs[i]`` is the engine's log-prob of a sampled id, 0.0 on environment tokens.
    turns: [(start, end)] each assistant turn's slice of ``response_ids``.
    turn_rewards: the environment's reward for each assistant turn (its step after that turn; 0.0 when the turn
        was cut at the length limit and no step ran).
    messages: the whole conversation (prompt messages first; assistant content is the decoded sampled text).
    finish_reason: "stop" (the environment said done), "length" (the token budget ran out) or "turn_limit".
    truncations: why anything was cut ("tool output: ...", "trajectory budget", "turn limit").
    """

    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    finish_reason: str = ""
    truncations: list[str] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    num_user_turns: int = 0

    def add_assistant(self, ids: list[int], logprobs: list[float]) -> None:
        start = len(self.response_ids)
        self.response_ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        self.turns.append((start, len(self.response_ids)))

    def add_environment(self, ids: list[int]) -> None:
        self.response_ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))

    @property
    def num_assistant_turns(self) -> int:
        return len(self.turns)

    @property
    def reward(self) -> float:
        """The environment's rewards summed over the turns."""
        return float(sum(self.turn_rewards))

    @property
    def assistant_tokens(self) -> int:
        return sum(self.mask)

    @property
    def environment_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)

    def turn_end_rewards(self) -> list[float]:
        """[R] each turn's reward on the last token of its assistant turn, 0.0 elsewhere (for per-turn credit)."""
        out = [0.0] * len(self.response_ids)
        for (start, end), reward in zip(self.turns, self.turn_rewards):
            if end > start:
                out[end - 1] += reward
        return out
