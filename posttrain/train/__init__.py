"""Training machinery: trainable roles (optimizer and schedule), losses, the update loop, checkpoints."""
