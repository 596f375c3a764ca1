"""The order a rank reads its training shard in: a fresh permutation each epoch, a pure function of the
seed and the epoch, so a stream can start at any position without reading what comes before it.

Element k of a rank's stream is `epoch_permutation(n, seed, k // n)[k % n]`: a run resumed after k
elements computes one permutation (O(n) integers, whatever k is) and starts in the middle of it.
"""

import tensorflow as tf

# Philox on every device: the same seed gives the same permutation on CPU and accelerators.
_ALGORITHM = "philox"
# The stream's epochs are numbered up to this (endless for any run).
EPOCHS = 2**62


def epoch_seed(seed, epoch):
    """Seed (int64 tensor of shape (2,)) of one epoch's permutation: (seed, epoch)."""
    return tf.stack([tf.cast(seed, tf.int64), tf.cast(epoch, tf.int64)])


def epoch_permutation(num_examples, seed, epoch):
    """The order (int64 tensor of shape (num_examples,), a permutation of 0..n-1) of epoch `epoch`."""
    indices = tf.range(num_examples, dtype=tf.int64)
    return tf.random.experimental.stateless_shuffle(indices, seed=epoch_seed(seed, epoch), alg=_ALGORITHM)


def index_stream(num_examples, seed, start=0):
    """Endless `tf.data.Dataset` of int64 indices in [0, num_examples): the permutation of each epoch in
    turn, from element `start` of that stream on (at the cost of one permutation, whatever `start`).
    Raises ValueError for `num_examples` < 1 or `start` < 0."""
    if num_examples < 1 or start < 0:
        raise ValueError(f"index_stream needs num_examples >= 1 and start >= 0, got {num_examples}, {start}.")
    first_epoch, offset = divmod(int(start), int(num_examples))

    def epoch(e):
        order = epoch_permutation(num_examples, seed, e)
        begin = tf.where(e == first_epoch, tf.constant(offset, tf.int64), tf.constant(0, tf.int64))
        return tf.data.Dataset.from_tensor_slices(order[begin:])

    return tf.data.Dataset.range(first_epoch, EPOCHS).flat_map(epoch)
