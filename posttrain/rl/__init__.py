"""RL runs: the one builder, the step, the loop, validation and the eval command."""
