"""What a data set of `hvd_lars.data` is: the `Dataset` entry of its registry, the `InputRequest` its
builder is given (with the data set's own options), and what it gives back (`InputPipeline` built,
`InputShapes` described)."""

import dataclasses
import typing

import tensorflow as tf


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputRequest:
    """What every data set's builder is given: which rank's shard, in batches of what size, from where.

    Attributes:
        per_rank_batch: images per training batch on this rank (a micro-batch under accumulation).
        rank, world_size: this rank among `world_size` (0 <= rank < world_size); the builder reads rank
            `rank`'s shard (`hvd_lars.data.sharding`).
        seed: int >= 0; the training order and any random augmentation follow from (seed + rank).
        data_dir: folder holding the data set; None or "": the data set's default.
        max_train_examples, max_eval_examples: > 0 keep only that many training / evaluation images
            (each data set says which); 0: all.
        eval_batch: images per evaluation batch; 0: the data set's own (Fashion-MNIST 1,000, the others
            `per_rank_batch`).
        deterministic: a fixed element order (exact resume, repeatable tests); False: faster, unordered.
        input_threads: tf.data threads of this rank's private pool; 0: as `tfdata_options.options` chooses.
        run_dir: a folder where a builder keeps what saves work on the run's later starts (image_folder:
            its listing index); None: nothing is kept.
        on_unreadable: None (a file that cannot be read or decoded stops the pipeline, naming it), or
            callable(path, split) called with it instead (`encoded_images.train_dataset`).
    """

    per_rank_batch: int
    rank: int
    world_size: int
    seed: int
    data_dir: str | None = None
    max_train_examples: int = 0
    max_eval_examples: int = 0
    eval_batch: int = 0
    deterministic: bool = True
    input_threads: int = 0
    run_dir: str | None = None
    on_unreadable: typing.Callable | None = None


@dataclasses.dataclass(frozen=True)
class InputPipeline:
    """The data one rank trains and evaluates on.

    Attributes:
        train: infinite `tf.data.Dataset` of (images float32 (B, H, W, C), labels int32 (B,)), B the
            per-rank batch, reshuffled every epoch.
        train_from: callable(start_batch: int >= 0) -> the same stream from its batch `start_batch` on,
            for a resumed run; the elements before it are never read or decoded.
        eval: finite dataset of this rank's evaluation shard, same element structure, last batch smaller.
        num_train_examples, num_eval_examples: examples in the whole data set (all ranks).
        num_classes, input_shape: labels, and (H, W, C) of one image.
        skipped_corrupt: int64 `tf.Variable` counting corrupt training files skipped so far, or None
            when the pipeline does not skip them.
        validation, num_validation_examples: this rank's shard of the split held out of the training set
            (as `eval`) and its size (all ranks); None and 0 without one.
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
    request and options build (`num_train_examples` after caps and any held-out validation split)."""

    input_shape: tuple
    num_classes: int
    num_train_examples: int


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One entry of `hvd_lars.data.DATASETS`: `build(request, options)` -> `InputPipeline`,
    `describe(request, options)` -> the `InputShapes` it would give, `options` (a frozen dataclass of the
    data set's own options), `default_dir()` -> the folder read when `InputRequest.data_dir` is empty
    (None: it has none)."""

    build: typing.Callable
    describe: typing.Callable
    options: type
    default_dir: typing.Callable = None

    def option_names(self):
        """The names of the options the data set takes, in their declared order."""
        return tuple(f.name for f in dataclasses.fields(self.options))
