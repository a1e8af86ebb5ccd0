"""RL runs: the one builder, the checks, the step's training phases, the train command, guards, Ray trainer ranks
and the eval command. A step's samples come from `collect/` (inline) or `overlap/` (ahead of training)."""
