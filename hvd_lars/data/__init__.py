"""Input pipelines, sharded per rank: `DATASETS` maps a `--dataset` name to its `Dataset` entry.

Every data set is built from one `InputRequest` (this rank's batch and shard, the seed, the data folder,
caps, threads) and its own options (`Dataset.options`, a frozen dataclass), and returns an
`InputPipeline` whose training stream can start at any batch (`InputPipeline.train_from`) without reading
the ones before. `describe_input` takes the same and says what the model and the plan need
(`InputShapes`: the image shape, the classes, the training examples) without building the input.

    from hvd_lars.data import InputRequest, get_input
    data = get_input("synthetic", InputRequest(per_rank_batch=32, rank=0, world_size=1, seed=0),
                     image_size=64)
"""

import hvd_lars

hvd_lars.require(__name__, ("tensorflow",))  # one line where TensorFlow cannot run

import dataclasses

from hvd_lars.data import (
    fashion_mnist,
    fashion_mnist_files,
    image_folder,
    imagenet,
    imagenet_preparation,
    synthetic,
)
from hvd_lars.data.interface import Dataset, InputPipeline, InputRequest, InputShapes

__all__ = [
    "DATASETS",
    "Dataset",
    "InputPipeline",
    "InputRequest",
    "InputShapes",
    "dataset",
    "describe_input",
    "get_input",
]

DATASETS = {
    "fashion_mnist": Dataset(
        build=fashion_mnist.fashion_mnist_input,
        describe=fashion_mnist.fashion_mnist_shapes,
        options=fashion_mnist.FashionMnistOptions,
        default_dir=lambda: fashion_mnist_files.DEFAULT_DIR,
    ),
    "imagenet2012": Dataset(
        build=imagenet.imagenet_input,
        describe=imagenet.imagenet_shapes,
        options=imagenet.ImagenetOptions,
        default_dir=imagenet_preparation.default_data_dir,
    ),
    "image_folder": Dataset(
        build=image_folder.image_folder_input,
        describe=image_folder.image_folder_shapes,
        options=image_folder.ImageFolderOptions,
    ),
    "synthetic": Dataset(
        build=synthetic.synthetic_input,
        describe=synthetic.synthetic_shapes,
        options=synthetic.SyntheticOptions,
    ),
}


def dataset(name):
    """The `Dataset` entry of `name`.

    Raises:
        ValueError: unknown name, listing the valid ones.
    """
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; valid names: {', '.join(sorted(DATASETS))}.")
    return DATASETS[name]


def get_input(name, request, **options):
    """Builds this rank's input pipeline of data set `name` (a key of `DATASETS`).

    Args:
        request: `InputRequest` (rank, world size, per-rank batch, seed, data folder, ...).
        **options: the data set's own options (fields of its `Dataset.options`); those not given keep
            their defaults.

    Returns:
        `InputPipeline`.

    Raises:
        ValueError: unknown name (listing the valid ones), or an option the data set does not take (one
            line naming it and the options it takes); otherwise what the builder raises.
    """
    entry = dataset(name)
    return entry.build(request, _options(name, entry, options))


def describe_input(name, request, **options):
    """`InputShapes` (image shape, classes, training examples) of the input `get_input(name, request,
    **options)` would build, without building it: nothing is allocated at the batch size, no image is
    decoded.

    - synthetic: from the arguments alone;
    - fashion_mnist: from the IDX headers of the training files;
    - image_folder: from the training split's listing index in the run directory while it is valid
      (`listing.listed`: a `stat` per folder), else from a listing of `data_dir/train`, saved there
      for the run's later starts (the validation split, which the shapes do not need, is left unread);
    - imagenet2012: from the prepared data's dataset info (data that are not prepared are refused, as
      `get_input` refuses them: `imagenet_preparation.NotPrepared`, naming the command that prepares).
    In a job, one process describes and shares the result (`hvd_lars.training.train`), so a listing
    is made once.

    Raises:
        ValueError: as `get_input` for the arguments; otherwise what the data set raises for the files
            the description reads (missing data, an unreadable header or listing).
    """
    entry = dataset(name)
    return entry.describe(request, _options(name, entry, options))


def _options(name, entry, given):
    """`entry.options` made of `given` (a dict).

    Raises:
        ValueError: a key that is not an option of the data set, naming it and those it takes.
    """
    wrong = sorted(set(given) - set(entry.option_names()))
    if wrong:
        request_fields = {f.name for f in dataclasses.fields(InputRequest)}
        where = [f"{k} is a field of InputRequest" for k in wrong if k in request_fields]
        raise ValueError(
            f"Dataset {name!r} does not take {', '.join(f'{k}={given[k]!r}' for k in wrong)}; "
            f"it takes {', '.join(entry.option_names()) or 'no options'}"
            + (f" ({'; '.join(where)})." if where else ".")
        )
    return entry.options(**given)
