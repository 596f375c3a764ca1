"""One rank of the 2-rank input test (run by tests/test_data_distributed.py through horovodrun).

Builds the image-folder pipeline for this rank, reads two training epochs of labels and the evaluation
shard, and runs the training loop's `ExactEvaluation` with a constant classifier whose logits are all 0:
with ties broken by class index (hvd_lars.metrics) it ranks class 0 first and classes 0-4 in its top 5,
so its exact top-1 and top-5 are known from the labels alone (counting ties as correct would give 1.0).
Counts the folder listings each rank makes (`listing.list_split`, counted here): built twice with one
index folder (a run and its resume), then on a folder the listing refuses (`<data>/../bad`).
Writes <out>/data_rank<r>_of_<size>.npz.
"""

import os
import sys

import numpy as np

PER_RANK_BATCH = 2


def main(data_dir, out_dir):
    from hvd_lars.parallel import collectives

    rank, size = collectives.init()
    import itertools

    import keras

    from hvd_lars.data import InputRequest, get_input, listing
    from hvd_lars.training.epoch_logs import ExactEvaluation

    listings = []
    list_split = listing.list_split

    def counted(root, classes=None):
        listings.append(os.path.basename(root))
        return list_split(root, classes)

    listing.list_split = counted
    # The listings are kept in <out>/image_folder_index, as in a run directory.
    request = lambda folder: InputRequest(
        per_rank_batch=PER_RANK_BATCH, rank=rank, world_size=size, seed=0, data_dir=folder, run_dir=out_dir
    )
    build = lambda folder: get_input("image_folder", request(folder), image_size=32)
    data = build(data_dir)
    first_listings = list(listings)
    resumed = build(data_dir)  # a later start of the run: the index, no listing
    assert resumed.num_train_examples == data.num_train_examples
    try:
        build(os.path.join(os.path.dirname(data_dir), "bad"))
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    steps_per_epoch = data.num_train_examples // (PER_RANK_BATCH * size)
    train = [y.numpy() for _, y in itertools.islice(data.train, 2 * steps_per_epoch)]
    evaluation = [y.numpy() for _, y in data.eval]

    classes = data.num_classes
    model = keras.Sequential(
        [
            keras.Input(data.input_shape),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(classes, kernel_initializer="zeros", bias_initializer="zeros"),
        ]
    )
    callback = ExactEvaluation(data.eval, data.num_eval_examples, every_epochs=1, last_epoch=1)
    callback.set_model(model)
    logs = {}
    callback.on_epoch_end(0, logs)  # raises unless the ranks together counted every image once
    os.makedirs(out_dir, exist_ok=True)
    np.savez(
        os.path.join(out_dir, f"data_rank{rank}_of_{size}.npz"),
        train=np.concatenate(train),
        eval=np.concatenate(evaluation),
        steps_per_epoch=steps_per_epoch,
        num_eval_examples=data.num_eval_examples,
        top1=logs["test_top1"],
        top5=logs["test_top5"],
        first_listings=np.array(first_listings, dtype=str),
        listings=np.array(listings, dtype=str),
        refusal=refusal,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
