"""The gateway: the policy served as an OpenAI-compatible endpoint during rollout, each call's exact token ids
captured, and trajectories assembled from them (docs/harnesses.md).

``server.Gateway`` serves ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` (and the same under a
per-trajectory ``/s/<session>/v1``); ``capture`` builds each session call's prompt ids exactly and keeps its
``CallRecord``s; ``protocol`` is the wire format; ``harness`` runs a user's agent per trajectory and ``assemble``
turns its calls into samples. Only the standard library and posttrain are used.
"""

from posttrain.gateway.capture import CallRecord
from posttrain.gateway.server import Backend, Gateway, SessionHandle

__all__ = ["Backend", "CallRecord", "Gateway", "SessionHandle"]
