"""Call records built by hand for the gateway's tests, with the fields the server's CallRecord has
(posttrain.gateway.capture, the A/B contract): a stand-in until the server module is in the tree."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StandInCallRecord:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "eos"
    extends_previous: bool = False
    messages: list[dict] = field(default_factory=list)
    text: str = ""
    overridden: list[str] = field(default_factory=list)


def record(prompt, completion, extends=False, **kw) -> StandInCallRecord:
    """A record whose log-probs are -0.1 * (k + 1) per completion id k."""
    return StandInCallRecord(
        list(prompt),
        list(completion),
        [-0.1 * (k + 1) for k in range(len(completion))],
        extends_previous=extends,
        **kw,
    )
