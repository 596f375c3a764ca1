"""Training order over record files (TFRecord shards of tensorflow-datasets), startable at any element.

Record files cannot be read at an arbitrary record, so a rank's records are cut into blocks (the file
ranges of its slice, optionally cut smaller); each epoch permutes the blocks (a pure function of the seed
and the epoch, as `order.epoch_permutation`), reads `window_records` records' worth of consecutive blocks
at a time and permutes that whole window. Element k of the stream is thus known without reading: a run
resumed after k elements reads only the window holding element k (docs/design.md, "Record order").

A block whose file cannot be opened or read to the block's end (a `tf.errors.DataLossError`, fewer records
than the data set's info counts, a file gone) yields the records read before the damage, then one
`unreadable(filename)` element in place of the rest, and the stream goes on.
"""

import numpy as np
import tensorflow as tf

from hvd_lars.data import order


def _read_records(filename, skip, take):
    # Reads records skip .. skip + take - 1 of one file (tests count the records read through it).
    return tf.data.TFRecordDataset(filename).skip(skip).take(take)


# No serialized tf.train.Example starts with a zero byte (a protobuf field number is never 0).
_UNREADABLE = "\0hvd_lars: unreadable record file\0"


def unreadable(filename):
    """The element that stands for the records of `filename` (string tensor) that could not be read."""
    return tf.strings.join([_UNREADABLE, filename])


def unreadable_file(record):
    """(is_unreadable: bool, filename: string) of a record (scalar string tensor) of `record_stream` or
    `record_sequence`: whether it is an `unreadable(filename)` element, and its filename if so."""
    n = len(_UNREADABLE)
    is_unreadable = tf.strings.substr(record, 0, n) == _UNREADABLE
    return is_unreadable, tf.strings.substr(record, n, tf.maximum(tf.strings.length(record) - n, 0))


def _opens(filename):
    # Reads the file's first record: an iterator over a file that cannot be opened fails again at every
    # call, which ignore_errors would retry for ever (TensorFlow 2.21); a map's failed element it drops.
    first = tf.data.TFRecordDataset(filename).take(1).get_single_element()
    with tf.control_dependencies([first]):
        return tf.identity(filename)


def _readable_block(filename, skip, take):
    """The block's records (`_read_records`), the records not read replaced by one `unreadable(filename)`
    (module docstring)."""
    opened = tf.data.Dataset.from_tensors(filename).map(_opens).ignore_errors()
    # After a DataLossError the record reader moves past the file: the block ends there.
    records = opened.flat_map(lambda f: _read_records(f, skip, take)).ignore_errors()
    # Read only when the records fall short of `take`.
    return records.concatenate(tf.data.Dataset.from_tensors(unreadable(filename))).take(take)


def blocks_of(file_instructions, block_records=0):
    """(filenames, skips, takes) arrays of the blocks: the file ranges, each cut into pieces of at most
    `block_records` records when > 0 (a piece that starts inside a file reads past the records before it
    in that file, undecoded)."""
    files, skips, takes = [], [], []
    for fi in file_instructions:
        step = block_records if block_records > 0 else max(fi.take, 1)
        for first in range(0, fi.take, step):
            files.append(fi.filename)
            skips.append(fi.skip + first)
            takes.append(min(step, fi.take - first))
    return np.array(files, dtype=object), np.array(skips, np.int64), np.array(takes, np.int64)


def record_stream(
    file_instructions, seed, start=0, window_records=10_000, block_records=0, deterministic=True
):
    """Endless `tf.data.Dataset` of serialized records (scalar string) in training order (module
    docstring) from element `start`, over tensorflow-datasets `FileInstruction`s (filename, skip, take) of
    this rank's slice, `window_records` records shuffled together, blocks of at most `block_records`
    records (0: one per file range); `deterministic` False lets file reads return out of order. Raises
    ValueError for no records or `start` < 0."""
    files, skips, takes = blocks_of(file_instructions, block_records)
    num_records = int(takes.sum())
    if num_records < 1 or start < 0:
        raise ValueError(f"record_stream needs records and start >= 0, got {num_records} records, {start}.")
    per_window = max(1, int(round(window_records / takes.mean())))
    num_blocks = len(takes)
    num_windows = -(-num_blocks // per_window)
    largest_window = int(np.sort(takes)[::-1][:per_window].sum())
    files_t, skips_t, takes_t = tf.constant(files.astype(str)), tf.constant(skips), tf.constant(takes)

    def block_order(e):
        return order.epoch_permutation(num_blocks, seed, e)

    def window(e, w):
        blocks = block_order(e)[w * per_window : (w + 1) * per_window]
        parts = tf.data.Dataset.from_tensor_slices(
            (tf.gather(files_t, blocks), tf.gather(skips_t, blocks), tf.gather(takes_t, blocks))
        )
        records = parts.interleave(
            _readable_block,
            cycle_length=per_window,
            num_parallel_calls=per_window,
            deterministic=deterministic,
        )
        # The whole window as one tensor, permuted, then one record at a time again.
        window_seed = tf.random.experimental.stateless_fold_in(order.epoch_seed(seed, e), w + 1)
        shuffled = records.batch(largest_window).map(
            lambda r: tf.random.experimental.stateless_shuffle(r, seed=window_seed, alg="philox")
        )
        return shuffled.unbatch()

    def epoch(e, first_window=0):
        windows = tf.data.Dataset.range(first_window, num_windows)
        return windows.flat_map(lambda w: window(e, w))

    first_epoch, offset = divmod(int(start), num_records)
    # Which window of the first epoch holds the start, from the block sizes in that epoch's order.
    sizes = takes[block_order(first_epoch).numpy()]
    window_sizes = np.add.reduceat(sizes, np.arange(0, num_blocks, per_window))
    ends = np.cumsum(window_sizes)
    first_window = int(np.searchsorted(ends, offset, side="right"))
    skip = offset - (int(ends[first_window - 1]) if first_window else 0)
    later = tf.data.Dataset.range(first_epoch + 1, order.EPOCHS).flat_map(epoch)
    return epoch(first_epoch, first_window).skip(skip).concatenate(later)


def record_sequence(file_instructions, parallel_reads=4):
    """Finite `tf.data.Dataset` of the serialized records of `file_instructions`, each once, in a fixed
    order (`parallel_reads` files interleaved), damaged blocks as in `record_stream`; ValueError for none."""
    files, skips, takes = blocks_of(file_instructions)
    if int(takes.sum()) < 1:
        raise ValueError(f"record_sequence needs records, got {len(files)} empty file ranges.")
    parts = tf.data.Dataset.from_tensor_slices((files.astype(str), skips, takes))
    return parts.interleave(
        _readable_block, cycle_length=parallel_reads, num_parallel_calls=parallel_reads, deterministic=True
    )
