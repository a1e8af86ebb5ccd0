"""Pure-tensor RL algorithms: advantage estimators, policy/value losses, KL, loss aggregation.

Every function takes and returns tensors (no model, no distribution, no config objects); registries are keyed by
the config names, so a trainer looks a component up by the string in its config. Import from the modules
(``posttrain.algorithms.advantages``, ...): this package imports nothing itself, so ``names`` (the torch-free
name tables the config reads) loads without torch.
"""
