"""An OpenAI-compatible endpoint over posttrain's rollout engine, recording each call's exact tokens.

``server.Gateway`` serves ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` (and the same under a
per-trajectory ``/s/<session>/v1``); ``capture`` builds each session call's prompt ids exactly and keeps its
``CallRecord``s; ``protocol`` is the wire format. Only the standard library and posttrain are used.
"""

from posttrain.gateway.capture import CallRecord
from posttrain.gateway.server import Backend, Gateway, SessionHandle

__all__ = ["Backend", "CallRecord", "Gateway", "SessionHandle"]
