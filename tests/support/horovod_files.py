"""Runs one of Horovod 0.28.1's own files on this rank as a user's script ported to Keras 3 by its import:
`horovod.tensorflow.keras` (and `horovod.keras`) is `hvd_lars.parallel.horovod_keras`, MNIST is local
Fashion-MNIST, and the Keras 3 renames of `RENAMES` are applied to the file's text as it is read.

Usage:
  horovod_files.py example OUT_DIR FILE [--steps-per-epoch=S] [--epochs=E] [ARGS...]
      FILE as __main__, each `fit` capped at S steps per epoch and E epochs; OUT_DIR/rankR.npz: weights,
      update count, rate, the fits run (epochs, steps), and on rank 0 the top-1 on the first `TOP1_IMAGES`
      of Fashion-MNIST's test set.
  horovod_files.py pytest OUT_DIR FILE
      FILE's tests under pytest, those of `NOT_UNDER_KERAS_3` skipped with their reason; OUT_DIR/rankR.xml.
"""

import os
import re
import sys

# Horovod 0.28.1's own files: shared/horovod-0.28.1 beside the checkout, or $HVD_LARS_HOROVOD_FILES
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOROVOD_FILES = os.environ.get("HVD_LARS_HOROVOD_FILES") or os.path.normpath(
    os.path.join(_REPO, "..", "shared", "horovod-0.28.1")
)

# The top-1's test images: 200 or so of each class, 0.9 points of standard error at 80 % (10,000 would
# take rank 0 about 8 s of CPU more on these 2-core machines, while the other rank waits).
TOP1_IMAGES = 2000

# (pattern, replacement, the rename as the README's table gives it, why Keras 3 needs it).
RENAMES = [
    (r",\s*experimental_run_tf_function=False", lambda m: "\n" * m.group(0).count("\n"),  # lines kept
     "`compile(..., experimental_run_tf_function=False)` -> `compile(...)`",
     "Keras 3's compile has no such argument"),
    (r"optimizer\.lr\b", "optimizer.learning_rate",
     "`optimizer.lr` -> `optimizer.learning_rate`", "Keras 3 optimizers have no lr"),
    (r"tf\.keras\.backend\.set_value\(([^,\n]+),\s*([^\n]+)\)", r"\1.assign(\2)",
     "`tf.keras.backend.set_value(x, value)` -> `x.assign(value)`",
     "Keras 3's set_value reads x.dtype.name; a Keras 3 variable's dtype is a string"),
    (r"\(lr=", "(learning_rate=",
     "`RMSprop(lr=...)` -> `RMSprop(learning_rate=...)`", "Keras 3 optimizers refuse lr="),
    (r"keras\.layers\.ThresholdedReLU\(([^)]*)\)", r"keras.layers.ReLU(threshold=\1)",
     "`keras.layers.ThresholdedReLU(theta)` -> `keras.layers.ReLU(threshold=theta)`",
     "Keras 3 removed ThresholdedReLU"),
    (r"keras\.losses\.mean_squared_error\b", "keras.losses.MSE",
     "`tf.keras.losses.mean_squared_error` -> `tf.keras.losses.MSE`",
     "Keras 3's tf.keras keeps the short name"),
    (r"\.ref\(\)", ".path",
     "`variable.ref()` -> `variable.path`",
     "Keras 3 variables have no ref(); the path is their hashable name"),
]  # fmt: skip

# Horovod's tests that do not apply under Keras 3 (tests/test_horovod_keras.py checks theirs in Keras 3).
NOT_UNDER_KERAS_3 = {
    "test_legacy_optimizer": "Keras 3 has no legacy optimizers (keras.optimizers.legacy.Adam raises on use)",
    "test_sparse_as_dense_with_grad_aggregation": "reads Horovod's private opt._agg_helper.counter",
    "test_grad_aggregation_with_inf_grad": "calls Keras 2's private optimizer._compute_gradients",
    "test_gradient_aggregation": "a Keras 2 optimizer (Optimizer(name) without a rate, update_step("
    "gradient, variable)), Keras 2's private _compute_gradients and Horovod's private _agg_helper",
    "test_gradient_aggregation_with_local_vars": "as test_gradient_aggregation",
    "test_partial_distributed_optimizer": "calls Keras 2's private optimizer._compute_gradients(loss, "
    "variables, tape=...)",
}


def renamed_source(path):
    """(text of `path` with `RENAMES` applied, {rename: number of places changed})."""
    with open(path) as f:
        text = f.read()
    counts = {}
    for pattern, replacement, rename, _ in RENAMES:
        text, n = re.subn(pattern, replacement, text)
        if n:
            counts[rename] = n
    return text, counts


def ported(path):
    """`path`'s text renamed (the renames printed), with `import horovod.tensorflow.keras` (and
    `horovod.keras`) giving hvd_lars's Keras 3 layer."""
    import horovod
    import horovod.tensorflow

    from hvd_lars.parallel import horovod_keras

    for name in ("horovod.tensorflow.keras", "horovod.keras"):
        sys.modules[name] = horovod_keras
        sys.modules[name + ".callbacks"] = horovod_keras.callbacks
        sys.modules[name + ".elastic"] = horovod_keras.elastic
    horovod.tensorflow.keras = horovod.keras = horovod_keras
    text, counts = renamed_source(path)
    print(f"horovod_files: renames {counts}", flush=True)
    return text


def point_mnist_at_fashion_mnist():
    """`keras.datasets.mnist.load_data` (`keras` and `tf.keras`) returns Fashion-MNIST in MNIST's shapes."""
    import keras
    import numpy as np
    import tensorflow as tf

    from hvd_lars.data import fashion_mnist_files

    def load_data(path="mnist.npz"):
        splits = [fashion_mnist_files.load(split) for split in ("train", "test")]
        return tuple((images[..., 0], labels.astype(np.uint8)) for images, labels in splits)

    keras.datasets.mnist.load_data = load_data
    tf.keras.datasets.mnist.load_data = load_data


def record_fits(caps):
    """Wraps `keras.Model.fit`: caps its `steps_per_epoch` and `epochs` at `caps` (a dict of those names),
    prints a line per call with this process's id and rank; returns {"model": the last model fitted, "fits":
    [(epochs, steps) of each call]}."""
    import keras

    from hvd_lars.parallel import collectives

    record, original = {"model": None, "fits": []}, keras.Model.fit

    def fit(model, *args, **kwargs):
        for name, cap in caps.items():
            if (kwargs.get(name) or 0) > cap:
                kwargs[name] = cap
        epochs, steps = kwargs.get("epochs", 1), kwargs.get("steps_per_epoch")
        record["model"] = model
        record["fits"].append((epochs, steps or 0))
        where = f"rank {collectives.rank()} of {collectives.size()}"
        print(f"horovod_files: pid {os.getpid()} fit epochs={epochs} steps={steps} on {where}", flush=True)
        return original(model, *args, **kwargs)

    keras.Model.fit = fit
    return record


def run_example(out_dir, path, *args):
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores
    tf.config.threading.set_inter_op_parallelism_threads(1)
    caps = {}
    while args and args[0].startswith(("--steps-per-epoch=", "--epochs=")):
        name, value = args[0][2:].split("=")
        caps[name.replace("-", "_")], args = int(value), args[1:]
    text = ported(path)
    point_mnist_at_fashion_mnist()
    recorder = record_fits(caps)
    sys.argv = [path, *args]
    exec(compile(text, path, "exec"), {"__name__": "__main__", "__file__": path})

    from hvd_lars.optim.wrapping import to_float
    from hvd_lars.parallel import collectives

    model = recorder["model"]
    record = {f"w{i}": w.numpy() for i, w in enumerate(model.trainable_variables)}
    record.update(
        iterations=int(model.optimizer.iterations),
        learning_rate=to_float(model.optimizer.learning_rate),
        optimizer=type(model.optimizer).__name__,
        compression=str(getattr(model.optimizer, "compression", "")),
        fits=np.asarray(recorder["fits"]),
        size=collectives.size(),
    )
    if collectives.rank() == 0 and model.input_shape[1:] == (28, 28, 1):
        from hvd_lars.data import fashion_mnist_files

        images, labels = (a[:TOP1_IMAGES] for a in fashion_mnist_files.load("test"))
        predictions = model.predict(images / 255.0, batch_size=1000, verbose=0)
        record["test_top1"] = float((predictions.argmax(axis=1) == labels).mean())
    np.savez(os.path.join(out_dir, f"rank{collectives.rank()}.npz"), **record)


def not_under_keras_3(name):
    """The reason `NOT_UNDER_KERAS_3` gives for test `name` ("test_x_0_True" counts as "test_x"), or None."""
    for base, reason in NOT_UNDER_KERAS_3.items():
        if re.fullmatch(re.escape(base) + r"(_\d+(_\w*)?)?", name):
            return reason
    return None


class _SkipNotUnderKeras3:
    """pytest plugin: marks the tests of `NOT_UNDER_KERAS_3` skipped, with their reason."""

    def pytest_collection_modifyitems(self, items):
        import pytest

        for item in items:
            reason = not_under_keras_3(item.originalname or item.name)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"not under Keras 3: {reason}"))


def run_pytest(out_dir, path):
    import pytest

    text = ported(path)
    copy = os.path.join(out_dir, os.path.basename(path))
    with open(copy, "w") as f:
        f.write(text)
    rank = os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    ini = os.path.join(out_dir, "pytest.ini")
    with open(ini, "w") as f:
        f.write("[pytest]\n")
    args = [copy, "-c", ini, "--rootdir", out_dir, "-p", "no:cacheprovider", "-q", "-rs"]
    args += ["--junitxml", os.path.join(out_dir, f"rank{rank}.xml")]
    sys.exit(pytest.main(args, plugins=[_SkipNotUnderKeras3()]))


if __name__ == "__main__":
    mode, out, file, *rest = sys.argv[1:]
    if mode == "example":
        run_example(out, file, *rest)
    else:
        run_pytest(out, file)
