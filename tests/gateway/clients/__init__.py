"""Agents written only against their own client libraries (openai, the Agents SDK, LangGraph, smolagents,
verifiers), used as ``harness.path=<file>:run``: nothing here imports posttrain. Each returns
``{"reward", "metrics"}`` with the tool calls it ran counted, so a test can see the library handled them."""
