"""`InputPipeline`: what every dataset builder of `hvd_lars.data` returns for one rank; `InputShapes`: what
`hvd_lars.data.describe_input` says of an input without building it."""

import dataclasses

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class InputPipeline:
    """The data one rank trains and evaluates on.

    Attributes:
        train: infinite `tf.data.Dataset` of (images float32 (B, H, W, C), labels int32 (B,)), B the
            per-rank batch, reshuffled every epoch (`order`: a permutation per epoch from the seed).
        train_from: callable(start_batch: int >= 0) -> the same stream from its batch `start_batch` on
            (exactly batches start_batch, start_batch + 1, ... of `train`), for a resumed run: the
            elements before it are never read or decoded, so starting costs the same at any batch.
        eval: finite dataset of this rank's evaluation shard, same element structure, last batch smaller.
        num_train_examples: training examples in the whole data set (all ranks).
        num_eval_examples: evaluation examples in the whole data set (all ranks).
        num_classes: number of labels.
        input_shape: (H, W, C) of one image.
        skipped_corrupt: int64 `tf.Variable` counting corrupt training files skipped so far, or None
            when the pipeline does not skip them (then a corrupt file raises an error naming it).
        validation: finite dataset of this rank's shard of the validation split (images held out of the
            training set, never trained on; for choosing hyperparameters), same structure as `eval`; None
            when the run holds out none.
        num_validation_examples: validation examples in the whole split (all ranks); 0 without one.
    """

    train: tf.data.Dataset
    train_from: object
    eval: tf.data.Dataset
    num_train_examples: int
    num_eval_examples: int
    num_classes: int
    input_shape: tuple
    skipped_corrupt: object = None
    validation: object = None
    num_validation_examples: int = 0


@dataclasses.dataclass(frozen=True)
class InputShapes:
    """What a model and its plan need to know of an input, read without building it
    (`hvd_lars.data.describe_input`): the fields of the same name of the `InputPipeline` the same
    arguments build.

    Attributes:
        input_shape: (H, W, C) of one image.
        num_classes: number of labels.
        num_train_examples: training examples in the whole data set (all ranks), after
            `max_train_examples` and any held-out validation split.
    """

    input_shape: tuple
    num_classes: int
    num_train_examples: int
