"""Input pipelines, sharded per rank: `DATASETS` maps a `--dataset` name to its `Dataset` entry.

Every data set is built from one `InputRequest` and its own options (`Dataset.options`) into an
`InputPipeline` whose training stream can start at any batch without reading the ones before;
`describe_input` says what the model and the plan need (`InputShapes`) without building the input.

    from hvd_lars.data import InputRequest, get_input
    data = get_input("synthetic", InputRequest(per_rank_batch=32, rank=0, world_size=1, seed=0),
                     image_size=64)
"""

import hvd_lars

hvd_lars.require(__name__)  # one line where TensorFlow cannot run

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
    """The `Dataset` entry of `name`; ValueError for an unknown name, listing the valid ones."""
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; valid names: {', '.join(sorted(DATASETS))}.")
    return DATASETS[name]


def get_input(name, request, **options):
    """Builds this rank's `InputPipeline` of data set `name` (a key of `DATASETS`) for `request` (an
    `InputRequest`); `**options`: fields of the data set's `Dataset.options` (the others keep defaults).
    Raises ValueError for an unknown name (listing the valid ones) or an option the data set does not
    take (naming it and those it takes), and what the builder raises."""
    entry = dataset(name)
    return entry.build(request, _options(name, entry, options))


def describe_input(name, request, **options):
    """`InputShapes` of the input `get_input(name, request, **options)` would build, without building it:
    from the arguments (synthetic), the IDX headers (fashion_mnist), the training split's listing or its
    index (image_folder), the prepared data's dataset info (imagenet2012). Raises as `get_input` for the
    arguments, and what the data set raises for the files it reads."""
    entry = dataset(name)
    return entry.describe(request, _options(name, entry, options))


def _options(name, entry, given):
    """`entry.options` made of `given` (a dict); ValueError for a key that is not one of its fields."""
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
