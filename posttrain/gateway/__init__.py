"""The gateway: the policy served as an OpenAI-compatible endpoint during rollout, each call's exact token ids
captured, and trajectories assembled from them (docs/harnesses.md). A layer beside posttrain.agents: it imports
agents, rollout.base and config; rl/collect and the CLI import it."""
