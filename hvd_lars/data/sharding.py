"""Which examples each rank reads: disjoint training shards of equal size, evaluation shards covering all.

Training: every rank must run the same number of steps per epoch, or the ranks that finish first would
wait forever in the next allreduce; so each rank takes `num_examples // world_size` examples and the at
most `world_size - 1` left over are not used. Evaluation: every example once across ranks (contiguous
ranges, sizes differing by at most one); no collective runs per batch, so unequal sizes cannot hang.
"""

import numpy as np


def check_rank(rank, world_size):
    if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}.")


def _per_rank(num_examples, rank, world_size):
    check_rank(rank, world_size)
    if num_examples // world_size == 0:
        raise ValueError(f"{num_examples} training examples cannot be shared by {world_size} ranks.")
    return num_examples // world_size


def train_shard_indices(num_examples, rank, world_size):
    """Indices (int64 array of length num_examples // world_size) of this rank's training shard:
    `rank::world_size`."""
    per_rank = _per_rank(num_examples, rank, world_size)
    return np.arange(rank, per_rank * world_size, world_size, dtype=np.int64)


def train_shard_range(num_examples, rank, world_size):
    """(start, stop) of this rank's contiguous training range, num_examples // world_size long: for record
    files already in a shuffled order (tensorflow-datasets), where a slice reads fewer files than a stride."""
    per_rank = _per_rank(num_examples, rank, world_size)
    return rank * per_rank, (rank + 1) * per_rank


def eval_shard_range(num_examples, rank, world_size):
    """(start, stop) of this rank's contiguous evaluation range; the ranges of all ranks tile [0, n)."""
    check_rank(rank, world_size)
    return (num_examples * rank) // world_size, (num_examples * (rank + 1)) // world_size
