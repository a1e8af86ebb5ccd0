"""Multi-turn agents: tools, the hermes tool-call format, incremental token rendering, trajectories, the
multi-turn driver, environments and their adapters (see docs/agents.md)."""
