"""Runs one of examples/ on this rank, then records what tests/test_examples.py checks: this rank's final
weights and, on rank 0, the model's top-1 on the 10,000 Fashion-MNIST test images.

Usage: example_runner.py OUT_DIR EXAMPLE [ARGS...]
"""

import os
import runpy
import sys

import numpy as np


def main(out_dir, example, *args):
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from hvd_lars.parallel import collectives

    rank, size = collectives.init()  # the example's own hvd.init() then returns at once
    print(f"example_runner: started as rank {rank} of {size}", flush=True)
    sys.argv = [example, *args]
    if example.endswith("tensorflow2_keras_mnist.py"):
        model = runpy.run_path(example)["train"](*(int(a) for a in args))
    else:
        model = runpy.run_path(example, run_name="__main__")["state"].model
    from hvd_lars.data import fashion_mnist

    record = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    record["iterations"] = int(model.optimizer.iterations)
    if collectives.rank() == 0:
        images, labels = fashion_mnist.load("test")
        predictions = model.predict(images / 255.0, batch_size=1000, verbose=0)
        record["test_top1"] = float((predictions.argmax(axis=1) == labels).mean())
    np.savez(os.path.join(out_dir, f"rank{collectives.rank()}.npz"), **record)
    print(f"example_runner: rank {collectives.rank()} done", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
