"""RL forward passes over a batch: padded, packed, prefix-grouped, the chunked log-prob head, and the options
that pick one for each pass."""
