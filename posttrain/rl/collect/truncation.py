"""Truncation masking (DAPO's "overlong filtering"; `algorithm.mask_truncated_samples`, posttrain's key).

A response cut off at data.max_response_length (finish reason "length") has no ending to be judged on; with the
switch on its tokens leave the loss (response mask zeroed). Its reward has already been placed and still counts
in its group's statistics, as a rejected token of the rollout-mismatch correction does.
"""

from __future__ import annotations

import torch

from posttrain.config.errors import ConfigError
from posttrain.data.batch import RolloutBatch
from posttrain.parallel.shares import SINGLE_SHARE, DataShare


def mask_truncated(
    batch: RolloutBatch, finish_reasons: list[str], share: DataShare = SINGLE_SHARE
) -> dict[str, float]:
    """Zero the response mask of the rows whose response hit the length limit (``finish_reasons`` in row
    order); returns how many rows that was (this share's). ConfigError when every row of the step (every
    share's, ``share``) was cut off: nothing would be left to learn from."""
    if len(finish_reasons) != batch.num_rows:
        raise ValueError(f"{len(finish_reasons)} finish reasons for a batch of {batch.num_rows} rows")
    truncated = torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)
    cut, rows = share.total([float(truncated.sum()), float(batch.num_rows)])
    if cut == rows:
        raise ConfigError(
            f"algorithm.mask_truncated_samples=true, and all {int(rows)} responses of this step were cut off "
            f"at data.max_response_length={batch.response_width} tokens, so none would be left in the loss; raise "
            "data.max_response_length, or set algorithm.mask_truncated_samples=false (with "
            "reward.overlong_buffer.enable=true to discourage long responses softly instead)"
        )
    batch.response_mask = batch.response_mask * (~truncated).unsqueeze(-1).to(batch.response_mask.dtype)
    return {"finish/num_masked_truncated": float(truncated.sum())}
