"""Batch layout: sequence packing, token-budget micro-batches (hard cap) and DP balancing.

The micro-batch loop with global loss normalisation is posttrain.train.update.
"""
