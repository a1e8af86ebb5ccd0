"""A 2-rank job for test_hung_rank: rank 1 hangs (sleeps) instead of joining a collective; rank 0 waits in
an all_reduce that times out after trainer.dist_timeout_s and handles the failure as the RL loop does."""

import sys
import time

import torch

from posttrain.parallel.runtime import abort_on_collective_failure, init_distributed

timeout_s = float(sys.argv[1])
ctx = init_distributed(torch.device("cpu"), timeout_s)
ctx.barrier()
if ctx.rank == 1:
    print("rank 1 hangs", flush=True)
    time.sleep(3600)
try:
    ctx.all_reduce_sum([1.0])
except Exception as exc:
    abort_on_collective_failure(exc, ctx, timeout_s)
    raise
print("unreachable: the all_reduce returned", flush=True)
