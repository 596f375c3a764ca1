"""What the Python fragments of README.md and docs/*.md assume, supplied for checks/test_readme_code.py.

A fragment names its preamble in a marker above its fence, `<!-- test: preamble=NAME ranks=N -->`. Each
`Preamble` has `before` (what the fragment takes as given: a small model, a few batches), `after` (what is
run after it, so the fragment's objects are used as a reader would use them: one `fit` epoch) and `expect`
(a line the run prints once per rank when the fragment did what it says).
"""

import collections

Preamble = collections.namedtuple("Preamble", "before after expect")

# A small uncompiled classifier and a few batches of Fashion-MNIST's shapes (random pixels, 10 classes).
_MODEL_AND_DATA = """\
import keras
import numpy as np
import tensorflow as tf

rng = np.random.default_rng(0)
images = rng.random((64, 28, 28, 1), dtype=np.float32)
labels = rng.integers(0, 10, 64)
data = tf.data.Dataset.from_tensor_slices((images, labels)).batch(16)
model = keras.Sequential(
    [keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(32, activation="relu"),
     keras.layers.Dense(10)]
)
"""

PREAMBLES = {
    # A fragment run on every rank of a job: `model` (uncompiled) and this rank's shard of the training and
    # validation batches; afterwards every rank's weights must be rank 0's.
    "model_and_shards": Preamble(
        before=_MODEL_AND_DATA
        + """
from hvd_lars.parallel import collectives

_rank, _size = collectives.init()
shard_of_this_rank = data.shard(_size, _rank)
val_shard = data.take(2).shard(_size, _rank)
""",
        after="""
import horovod.tensorflow as _hvd

_sums = _hvd.allgather_object([float(np.sum(w)) for w in model.get_weights()])
assert all(s == _sums[0] for s in _sums), _sums
print("readme fragment: every rank holds rank 0's weights")
""",
        expect="readme fragment: every rank holds rank 0's weights",
    ),
    # A fragment that fuses the batch norm of `model` and compiles it with its optimizer; one epoch of `data`
    # follows, on the fused layer.
    "model": Preamble(
        before=_MODEL_AND_DATA
        + """
model = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3),
                          keras.layers.BatchNormalization(), keras.layers.Flatten(), keras.layers.Dense(10)])
""",
        after="""
history = model.fit(data, epochs=1, verbose=0)
assert np.isfinite(history.history["loss"][-1]), history.history
assert type(model.layers[1]).__name__ == "FusedBatchNormalization", model.layers
print("readme fragment: trained one epoch")
""",
        expect="readme fragment: trained one epoch",
    ),
    # A fragment that trains a `model` compiled with a float-rate SGD (the warmup callbacks set its rate).
    "compiled_sgd_model": Preamble(
        before=_MODEL_AND_DATA
        + """
model.compile(optimizer=keras.optimizers.SGD(0.0, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
""",
        after="""
assert float(model.optimizer.learning_rate) > 0, "the callback set no rate"
print("readme fragment: trained with rate", float(model.optimizer.learning_rate))
""",
        expect="readme fragment: trained with rate",
    ),
}
