"""Which examples each rank reads: disjoint training shards of equal size, evaluation shards covering all.

Training: every rank must run the same number of steps per epoch, or the ranks that finish first would
wait forever in the next allreduce; so each rank takes `num_examples // world_size` examples (strided,
`rank::world_size`) and the at most `world_size - 1` left over are not used that epoch.
Evaluation: every example is evaluated exactly once across ranks (contiguous ranges, sizes differing by at
most one); no collective runs per batch, so unequal shard sizes cannot hang.
"""

import numpy as np


def check_rank(rank, world_size):
    if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}.")


def train_shard_indices(num_examples, rank, world_size):
    """Indices (int64 array of length num_examples // world_size) of this rank's training shard."""
    check_rank(rank, world_size)
    per_rank = num_examples // world_size
    if per_rank == 0:
        raise ValueError(f"{num_examples} training examples cannot be shared by {world_size} ranks.")
    return np.arange(rank, per_rank * world_size, world_size, dtype=np.int64)


def eval_shard_range(num_examples, rank, world_size):
    """(start, stop) of this rank's contiguous evaluation range; the ranges of all ranks tile [0, n)."""
    check_rank(rank, world_size)
    return (num_examples * rank) // world_size, (num_examples * (rank + 1)) // world_size


def train_shard_range(num_examples, rank, world_size):
    """(start, stop) of this rank's contiguous training range, num_examples // world_size long; the ranges
    are disjoint and the at most world_size - 1 last examples are left out. For record files whose order
    is already shuffled (tensorflow-datasets), where a contiguous slice reads fewer files than a stride."""
    check_rank(rank, world_size)
    per_rank = num_examples // world_size
    if per_rank == 0:
        raise ValueError(f"{num_examples} training examples cannot be shared by {world_size} ranks.")
    return rank * per_rank, (rank + 1) * per_rank
