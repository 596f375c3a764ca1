"""One rank of the 2-rank jobs of tests/test_distributed.py and tests/test_horovod_keras.py (`run` starts
one). Each argument "function:arg:..." calls `function(rank, size, *args)` (an arg that names a function of
this module: that function), on one rank for a function of `ONE_RANK` (the ranks take those in turn); each
rank pickles {(function, *args): result} to OUT_DIR/rank<r>.pkl. Models have no batch norm: 2 ranks x B
rows give the updates of one process on 2B rows.

Usage: hvd_worker.py OUT_DIR FUNCTION[:ARG...]...
"""

import os
import pickle
import subprocess
import sys
import tempfile

import numpy as np

if __name__ == "__main__":  # a rank; the tests import this module for its names
    import keras
    import tensorflow as tf
    from keras.optimizers import SGD, Adam, Lamb, LossScaleOptimizer

    import hvd_lars.parallel.horovod_keras as hvd
    from hvd_lars import (
        LARS,
        BroadcastGlobalVariablesCallback,
        DistributedOptimizer,
        LearningRateWarmupCallback,
        MetricAverageCallback,
        WarmupPolynomialDecay,
    )
    from hvd_lars.parallel import collectives
    from hvd_lars.parallel.callbacks import average_metrics
    from hvd_lars.parallel.horovod_keras import PartialDistributedOptimizer

STEPS = 3
GLOBAL_BATCH = 8
RATES = [0.05, 0.02, 0.04]  # per batch, for the "variable" rates (set by a callback before each batch)
CLIPNORM = 0.05  # SGD's global_clipnorm: the test checks the gradient norm exceeds it
OUT_DIR = None  # the job's folder, shared by the ranks
ONE_RANK = ("one_process", "accumulation_reference", "first_gradient_norm")  # references: no collective


def run(out, calls):
    """Runs `calls` ((function, *args)) on 2 ranks as horovodrun starts MPI ranks, in Path `out`; returns
    (`results(function, *args)`: the results of that call, both ranks' or the one rank's, stdout)."""
    from hvd_lars.parallel.ompi_allreduce_rules import CPU_DEFAULTS
    from tests.support import REPO, TWO_RANKS
    from tests.support.main_server import served

    words = [":".join(_names(call)) for call in calls]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_coll")}  # no user's rules
    # The main program's Horovod CPU defaults: a rank waiting for the other polls less (2 ranks, 2 cores).
    env.update(CPU_DEFAULTS, TMPDIR=str(out), PYTHONPATH=REPO)
    cmd = served([*TWO_RANKS, sys.executable, os.path.abspath(__file__), str(out), *words], out, env)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=out)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    ranks = [pickle.loads((out / f"rank{rank}.pkl").read_bytes()) for rank in range(2)]

    def results(*call):
        return [r[_names(call)] for r in ranks if _names(call) in r]

    return results, result.stdout


def _names(call):
    """(function, *args) in words: a function by its name."""
    return tuple(getattr(word, "__name__", word) for word in call)


def main(out_dir, calls):
    global OUT_DIR
    OUT_DIR = out_dir
    rank, size = hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores
    results = {}
    for index, call in enumerate(calls):
        function, *args = words = tuple(call.split(":"))
        if function in ONE_RANK and index % size != rank:
            continue
        try:
            results[words] = globals()[function](rank, size, *[globals().get(arg, arg) for arg in args])
        except Exception as e:
            e.add_note(f"in hvd_worker.{function}{(rank, size, *args)}")  # the case, in the job's output
            raise
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(results, f)


def data(rank, size):
    """(x, y) of this rank (its slice of every step) and of the whole job."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, GLOBAL_BATCH, 4)).astype(np.float32)
    y = rng.normal(size=(STEPS, GLOBAL_BATCH, 2)).astype(np.float32)
    mine = slice(rank * GLOBAL_BATCH // size, (rank + 1) * GLOBAL_BATCH // size)
    return (x[:, mine].reshape(-1, 4), y[:, mine].reshape(-1, 2)), (x.reshape(-1, 4), y.reshape(-1, 2))


def make_model():
    """4 -> 3 (tanh) -> 2, from `initial_weights()`."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, "tanh"), keras.layers.Dense(2)])
    model.set_weights(initial_weights())
    return model


def one_weight_model(w=0.0):
    """y = w x."""
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer=keras.initializers.Constant(w))
    return keras.Sequential([keras.Input((1,)), dense])


def one_update(model, rank, callbacks=()):
    """One update on x = 1, y = 1 + 2 rank (mse: rank r's gradient is 2 (w - 1 - 2 r)); w after it."""
    x, y = np.ones((1, 1), np.float32), np.full((1, 1), 1.0 + 2.0 * rank, np.float32)
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, callbacks=list(callbacks))
    return float(model.trainable_variables[0].numpy().ravel()[0])


def state(model):
    """w, iterations and the optimizer's variables flattened."""
    return {
        "w": float(model.trainable_variables[0].numpy().ravel()[0]),
        "iterations": int(model.optimizer.iterations),
        "optimizer": [float(x) for v in model.optimizer.variables for x in np.asarray(v.numpy()).ravel()],
    }


def initial_weights():
    rng = np.random.default_rng(42)
    return [rng.normal(size=s, scale=0.5).astype(np.float32) for s in [(4, 3), (3,), (3, 2), (2,)]]


def fit(model, optimizer, x, y, batch_size, callbacks=(), epochs=1, run_eagerly=False):
    """`model.fit` with mse; `run_eagerly` for the one-process references (no graph to trace)."""
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False, run_eagerly=run_eagerly)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model


def values(variables):
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in variables]


def types(optimizer):
    return [type(optimizer).__name__, type(optimizer.inner_optimizer).__name__]


# The optimizer matrix of tests/test_distributed.py: each optimizer a function of its rate, each way of
# giving the rate a function of the optimizer's maker (returning the optimizer and the callbacks that change
# the rate), each nesting a function of the optimizer.
def sgd(rate):
    return SGD(rate, momentum=0.9, global_clipnorm=CLIPNORM)


def adam(rate):
    return Adam(rate, weight_decay=0.01)


def lamb(rate):
    return Lamb(rate)


def lars(rate):
    return LARS(rate, weight_decay=1e-3, eta=0.1)


def float_rate(make):
    return make(0.05), []


def schedule_rate(make):
    return make(keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)), []


def _callable_rate():
    return 0.03


def callable_rate(make):
    return make(_callable_rate), []


def variable_rate(make):
    """RATES[batch] before each batch: assigned to the keras.Variable LARS holds, set as the learning_rate of
    the others (Keras's optimizers take no Variable)."""
    held = keras.Variable(0.05) if make is lars else None

    class SetRate(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if held is not None:
                held.assign(RATES[batch])
            else:
                self.model.optimizer.learning_rate = RATES[batch]

    return make(0.05 if held is None else held), [SetRate()]


def bare(optimizer):
    return DistributedOptimizer(optimizer)


def lso_inside(optimizer):
    return DistributedOptimizer(LossScaleOptimizer(optimizer, initial_scale=64.0))


def lso_chosen(optimizer):
    """Made under mixed_float16, where DistributedOptimizer adds the loss scaler itself."""
    return chosen_under_mixed_float16(lambda: DistributedOptimizer(optimizer))


def chosen_under_mixed_float16(make):
    """`make()` under Keras's mixed_float16 policy (then float32 again)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return make()
    finally:
        keras.mixed_precision.set_global_policy("float32")


def scalar_steps(optimizer, grads_per_step):
    """[w, loss scale, iterations] after each gradient of one scalar weight w (from 0), in a tf.function."""
    w = keras.Variable(0.0)
    optimizer.build([w])
    step = tf.function(lambda g: optimizer.apply([g], [w]), autograph=False)
    out = []
    for g in grads_per_step:
        step(tf.constant(g, tf.float32))
        out.append([float(w.numpy()), float(optimizer.dynamic_scale.numpy()), int(optimizer.iterations)])
    return np.asarray(out)


def traced_update(optimizer, variables):
    """The graph of one `optimizer.apply` on float32 gradients of `variables` (traced, not run)."""
    optimizer.build(variables)
    update = tf.function(lambda *grads: optimizer.apply(list(grads), variables), autograph=False)
    return update.get_concrete_function(*[tf.TensorSpec(v.shape, tf.float32) for v in variables])


def one_process(rank, size, make, rate):
    """The reference of `two_ranks(make, rate, ...)`: the plain optimizer on the whole batch."""
    _, (x_all, y_all) = data(rank, size)
    optimizer, callbacks = rate(make)
    model = fit(make_model(), optimizer, x_all, y_all, GLOBAL_BATCH, callbacks, run_eagerly=True)
    return {"final": values(model.trainable_variables), "type": type(optimizer).__name__}


def two_ranks(rank, size, make, rate, wrap):
    """`make` with its rate given by `rate`, nested by `wrap`, on this rank's half of each batch: weights,
    optimizer state, and that state as a checkpoint and a .keras file restore it."""
    keras.saving.register_keras_serializable(package="hvd_worker")(_callable_rate)
    (x, y), _ = data(rank, size)
    optimizer, callbacks = rate(make)
    model = fit(make_model(), wrap(optimizer), x, y, GLOBAL_BATCH // size, callbacks)
    optimizer = model.optimizer
    result = {"final": values(model.trainable_variables), "state": values(optimizer.variables),
              "iterations": int(optimizer.iterations), "types": types(optimizer)}  # fmt: skip
    path = os.path.join(tempfile.mkdtemp(), "ckpt")
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(path)
    fresh = make_model()
    fresh.compile(optimizer=wrap(rate(make)[0]), loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(path).assert_consumed()
    result["checkpoint_state"] = values(fresh.optimizer.variables)
    model.save(path + ".keras")
    loaded = keras.models.load_model(path + ".keras")
    result["keras_state"] = values(loaded.optimizer.variables)
    result["keras_type"] = type(loaded.optimizer).__name__
    return result


def first_gradient_norm(rank, size):
    """The global norm of the first gradient on the whole batch (what SGD's global_clipnorm sees)."""
    _, (x_all, y_all) = data(rank, size)
    model = make_model()
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y_all[:GLOBAL_BATCH], model(x_all[:GLOBAL_BATCH]))
    return float(tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables)))


def loss_scaler_inside(rank, size):
    """DistributedOptimizer(LossScaleOptimizer(SGD(1.0), initial_scale=4)), scaled gradients 8 and 0."""
    optimizer = DistributedOptimizer(LossScaleOptimizer(SGD(1.0), initial_scale=4))
    return scalar_steps(optimizer, [8.0 if rank == 0 else 0.0])


def loss_scaler_chosen(rank, size):
    """The loss scaler chosen under mixed_float16, scale 4: gradients inf and 8, then 8 and 0."""
    chosen = chosen_under_mixed_float16(lambda: DistributedOptimizer(SGD(1.0)))
    chosen.inner_optimizer.initial_scale = 4.0
    return scalar_steps(chosen, [np.inf if rank == 0 else 8.0, 8.0 if rank == 0 else 0.0])


# The accumulating optimizers of tests/test_distributed.py: (2 micro-batches per update, the plain optimizer).
def sgd_adopted():
    """Keras's own gradient_accumulation_steps, taken over by the wrapper."""
    sgd = lambda **accumulation: SGD(0.05, momentum=0.9, **accumulation)  # noqa: E731
    return DistributedOptimizer(sgd(gradient_accumulation_steps=2)), sgd()


def adam_lso_chosen():
    make = lambda: DistributedOptimizer(Adam(0.01), backward_passes_per_step=2)  # noqa: E731
    return chosen_under_mixed_float16(make), Adam(0.01)


def lars_schedule_lso_inside():
    schedule = lambda: WarmupPolynomialDecay(peak_learning_rate=0.5, total_steps=STEPS, warmup_steps=1)  # noqa: E731
    scaled = LossScaleOptimizer(LARS(schedule(), eta=0.1), initial_scale=64.0)
    return DistributedOptimizer(scaled, backward_passes_per_step=2), LARS(schedule(), eta=0.1)


def accumulation(rank, size, accumulating):
    """The optimizer of `accumulating()` on 2 ranks x 2 micro-batches of 2 rows: final weights, [iterations,
    the wrapper's micro-batch counter]."""
    (x, y), _ = data(rank, size)
    model = fit(make_model(), accumulating()[0], x, y, GLOBAL_BATCH // size // 2)
    counts = [int(model.optimizer.iterations), int(model.optimizer._iterations)]  # updates, micro-batches
    return {"final": values(model.trainable_variables), "counts": counts}


def accumulation_reference(rank, size, accumulating):
    """The reference of `accumulation(accumulating)`: the plain optimizer on the 8 rows of each update."""
    _, (x_all, y_all) = data(rank, size)
    model = fit(make_model(), accumulating()[1], x_all, y_all, GLOBAL_BATCH, run_eagerly=True)
    return values(model.trainable_variables)


def allreduces_per_accumulation_branch(rank, size):
    """The HorovodAllreduce ops in each branch of a traced update's cond (backward_passes_per_step=2)."""
    optimizer = DistributedOptimizer(SGD(0.05), backward_passes_per_step=2)
    graph = traced_update(optimizer, make_model().trainable_variables).graph.as_graph_def()
    functions = {f.signature.name: f for f in graph.library.function}
    return [
        sum(n.op == "HorovodAllreduce" for n in functions[node.attr[branch].func.name].node_def)
        for node in graph.node
        if node.op in ("If", "StatelessIf")
        for branch in ("then_branch", "else_branch")
    ]


def gradient_reduction(rank, size, reduction, compression):
    """SGD under DistributedOptimizer(gradient_reduction=..., compression=...), gradients of other magnitudes
    per rank: final weights, a traced update's [allreduces, grouped allreduces, Horovod ops on float16]."""
    (x, y), _ = data(rank, size)
    make = lambda: DistributedOptimizer(  # noqa: E731
        SGD(0.05, momentum=0.9), gradient_reduction=reduction, compression=compression
    )
    model = fit(make_model(), make(), x, y * (1.0 + 3.0 * rank), GLOBAL_BATCH // size)
    ops = traced_update(make(), make_model().trainable_variables).graph.get_operations()
    kinds = [op.type for op in ops]
    halves = [op for op in ops if op.type.startswith("Horovod") and op.inputs[0].dtype == tf.float16]
    ops = [kinds.count("HorovodAllreduce"), kinds.count("HorovodGroupedAllreduce"), len(halves)]
    return {"final": values(model.trainable_variables), "ops": ops}


def metric_average(rank, size):
    """MetricAverageCallback with losses 10 and 20, val_losses 1 and 3: EarlyStopping's best, the history,
    average_metrics(model.evaluate())."""
    model = one_weight_model()
    model.compile(optimizer=DistributedOptimizer(SGD(0.0)), loss="mae", jit_compile=False)
    validation = (np.ones((1, 1), np.float32), np.full((1, 1), 1.0 + 2.0 * rank, np.float32))
    stop = keras.callbacks.EarlyStopping(monitor="val_loss")
    x, y = np.ones((2, 1), np.float32), np.full((2, 1), 10.0 * (rank + 1), np.float32)
    callbacks = [MetricAverageCallback(), stop]
    history = model.fit(x, y, epochs=2, verbose=0, validation_data=validation, callbacks=callbacks)
    evaluated = average_metrics(model.evaluate(*validation, verbose=0, return_dict=True))
    return {"best": float(stop.best), "evaluate": float(evaluated["loss"]), **history.history}


def warmup_rates(rank, size):
    """The rate before each of 12 updates: Horovod's warmup to 0.4 over 2 epochs of 4 updates; after update 10
    the user's own callback sets 0.1."""
    rates = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations) == 10:
                self.model.optimizer.learning_rate = 0.1

    x, y = np.zeros((16, 4), np.float32), np.zeros((16, 2), np.float32)
    warmup = LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2)
    fit(make_model(), DistributedOptimizer(SGD(0.0)), x, y, 4, [warmup, Record()], epochs=3)
    return rates


def batch_norm_statistics(rank, size):
    """Batch norm on other data per rank (mean 1 + 3 r, deviation 1 + r), 2 epochs of 2 LARS steps: its moving
    [mean, variance] at each epoch's end, recorded "before", "mid" and "after" in the callbacks [record,
    ExactEvaluation (epoch 2), record, PeriodicCheckpoint, record]; rank 0: the checkpoint's ("saved")."""
    from hvd_lars.training.checkpoints import PeriodicCheckpoint, moving_statistics
    from hvd_lars.training.epoch_logs import ExactEvaluation

    keras.utils.set_random_seed(100 + rank)
    rng = np.random.default_rng(rank)
    x = (1 + 3 * rank + (1 + rank) * rng.normal(size=(16, 4))).astype(np.float32)
    y = rng.integers(0, 3, size=16).astype(np.int32)
    bn = keras.layers.BatchNormalization(momentum=0.5)
    model = keras.Sequential([keras.Input((4,)), bn, keras.layers.Dense(3)])
    optimizer = DistributedOptimizer(
        LARS(WarmupPolynomialDecay(0.1, total_steps=4, warmup_steps=1), weight_decay=1e-4)
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=False)
    optimizer.build(model.trainable_variables)
    collectives.broadcast_variables(model.variables + optimizer.variables)
    assert len(moving_statistics(model)) == 2
    records = {}

    def record(when):
        def save(epoch, logs=None):
            records[f"{epoch + 1}_{when}"] = np.stack([bn.moving_mean.numpy(), bn.moving_variance.numpy()])

        return keras.callbacks.LambdaCallback(on_epoch_end=save)

    folder = tempfile.mkdtemp()
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), folder, 5)
    evaluation = tf.data.Dataset.from_tensor_slices((x[:6], y[:6])).batch(4)
    callbacks = [record("before"), ExactEvaluation(evaluation, 6 * size, every_epochs=2), record("mid"),
                 PeriodicCheckpoint(manager, every_steps=0), record("after")]  # fmt: skip
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    model.fit(train, epochs=2, steps_per_epoch=2, callbacks=callbacks, verbose=0, shuffle=False)
    if rank == 0:
        reader = tf.train.load_checkpoint(folder)
        saved = {n: reader.get_tensor(n) for n in reader.get_variable_to_shape_map() if "moving_" in n}
        assert len(saved) == 2, saved
        records["saved"] = np.stack(
            [next(v for n, v in saved.items() if f"moving_{k}" in n) for k in ("mean", "variance")]
        )
    return records


def image_folder_ranks(rank, size, data_dir, out_dir):
    """The image-folder pipeline on this rank (batch 2): two epochs of training labels, the evaluation shard's
    labels, ExactEvaluation's top-1/top-5 of an all-zero classifier, the folders listed by a build, by its
    resume (the index) and by a build on `<data>/../bad`, and that build's refusal."""
    from hvd_lars.data import InputRequest, get_input, listing
    from hvd_lars.training.epoch_logs import ExactEvaluation

    listings, list_split = [], listing.list_split

    def counted(root, classes=None):
        listings.append(os.path.basename(root))
        return list_split(root, classes)

    def build(folder):
        request = InputRequest(
            per_rank_batch=2, rank=rank, world_size=size, seed=0, data_dir=folder, run_dir=out_dir
        )
        return get_input("image_folder", request, image_size=32)

    listing.list_split = counted
    try:
        data = build(data_dir)
        first_listings = list(listings)
        assert build(data_dir).num_train_examples == data.num_train_examples
        try:
            build(os.path.join(os.path.dirname(data_dir), "bad"))
            refusal = ""
        except ValueError as e:
            refusal = str(e)
    finally:
        listing.list_split = list_split
    steps_per_epoch = data.num_train_examples // (2 * size)
    train = [y.numpy() for _, y in data.train.take(2 * steps_per_epoch)]
    zeros = keras.layers.Dense(data.num_classes, kernel_initializer="zeros", bias_initializer="zeros")
    model = keras.Sequential([keras.Input(data.input_shape), keras.layers.GlobalAveragePooling2D(), zeros])
    callback = ExactEvaluation(data.eval, data.num_eval_examples, every_epochs=1, last_epoch=1)
    callback.set_model(model)
    logs = {}
    callback.on_epoch_end(0, logs)  # raises unless the ranks together counted every image once
    evaluation = np.concatenate([y.numpy() for _, y in data.eval])
    return {"train": np.concatenate(train), "eval": evaluation, "steps_per_epoch": steps_per_epoch,
            "num_eval_examples": data.num_eval_examples, "top1": logs["test_top1"], "top5": logs["test_top5"],
            "first_listings": first_listings, "listings": listings, "refusal": refusal}  # fmt: skip


# `hvd_lars.parallel.horovod_keras` as `horovod.tensorflow.keras` (tests/test_horovod_keras.py).
def init_state(rank, size):
    rules = os.environ.get("OMPI_MCA_coll_tuned_dynamic_rules_filename")
    return {"rank": hvd.rank(), "size": hvd.size(), "cross_rank": hvd.cross_rank(),
            "initialized": hvd.is_initialized(), "rules": rules}  # fmt: skip


def optimizer_arguments(rank, size):
    """w after one update from w = 1 under each argument set of hvd.DistributedOptimizer(SGD(0.1)), and under
    hvd.load_model of a plain SGD(0.1) model one process saved (with its optimizer's types)."""
    cases = {
        "average": {},
        "sum": {"op": hvd.Sum},
        "predivide": {"gradient_predivide_factor": 2.0},
        "fp16_predivide": {"compression": hvd.Compression.fp16, "gradient_predivide_factor": 2.0},
        "groups_int": {"groups": 1},
        "groups_list": {},
    }
    out = {}
    for name, kwargs in cases.items():
        model = one_weight_model(1.0)
        if name == "groups_list":
            kwargs = {"groups": [[model.trainable_variables[0]]]}
        optimizer = hvd.DistributedOptimizer(SGD(0.1), **kwargs)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        out[name] = one_update(model, rank)
    path = os.path.join(OUT_DIR, "plain_sgd.keras")
    if rank == 0:
        model = one_weight_model(1.0)
        model.compile(optimizer=SGD(0.1), loss="mse")
        model.save(path)
    collectives.allreduce_sum([0.0], name="barrier")  # rank 1 reads the file only once it is written
    model = hvd.load_model(path)
    out["load_model"] = one_update(model, rank, [hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    out["load_model_types"] = types(model.optimizer)
    return out


def value_collectives(rank, size):
    @tf.function(autograph=False)
    def in_graph(x):
        return hvd.allreduce(x, name="in_graph", op=hvd.Sum)

    return {
        "allreduce": hvd.allreduce([rank + 1.0]).numpy().tolist(),
        "allreduce_sum": hvd.allreduce(np.float32(rank + 1.0), op=hvd.Sum).numpy().tolist(),
        "allreduce_variable": hvd.allreduce(keras.Variable([2.0 * rank])).numpy().tolist(),
        "allreduce_graph": in_graph(tf.constant([rank + 1.0])).numpy().tolist(),
        "allgather": hvd.allgather([[rank]]).numpy().tolist(),
        "broadcast": hvd.broadcast(10 * rank + 5, root_rank=1).numpy().tolist(),
        "reducescatter": hvd.reducescatter(np.arange(1.0, 5.0) * (rank + 1), op=hvd.Sum).numpy().tolist(),
        # The elastic loop's attempt counts: 1 on rank 0 (joined later), 3 on rank 1.
        "max_over_ranks": int(collectives.max_over_ranks(1 if rank == 0 else 3, name="t.counts")),
    }


def aggregation_with_local_vars(rank, size):
    """Horovod's test_gradient_aggregation_with_local_vars in Keras 3's API: x_i = [0], y_i = [1, 2] (8 each,
    4 of each local), loss x - (rank + 1) y[0], 10 passes, 4 per update, an optimizer adding the gradient."""

    class AddGradient(keras.optimizers.Optimizer):
        def update_step(self, gradient, variable, learning_rate):
            variable.assign_add(gradient)

    out = {}
    for average in (True, False):
        optimizer = hvd.DistributedOptimizer(
            AddGradient(learning_rate=0.1), backward_passes_per_step=4, average_aggregated_gradients=average
        )
        xs = [tf.Variable([0.0]) for _ in range(8)]
        ys = [tf.Variable([1.0, 2.0]) for _ in range(8)]
        for v in xs[:4] + ys[:4]:
            optimizer.register_local_var(v)

        @tf.function(autograph=False)
        def step(xs=xs, ys=ys, optimizer=optimizer):
            with tf.GradientTape() as tape:
                loss = tf.stack(xs) - float(rank + 1) * tf.gather(tf.stack(ys), [0], axis=1)
            grads = tape.gradient(loss, xs + ys)
            optimizer.apply_gradients(zip(grads, xs + ys))

        trace = []
        for _ in range(10):
            step()
            trace.append([float(v.numpy()[0]) for v in xs] + [float(v.numpy()[0]) for v in ys])
        out[average] = trace
    return out


def warmup_momentum_correction(rank, size):
    """hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=1), SGD(0.2, momentum=0.9),
    2 epochs of 2 updates on x = 1, y = 0: w after each update, the logged rates."""
    model = one_weight_model(1.0)
    optimizer = hvd.DistributedOptimizer(SGD(0.2, momentum=0.9))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    trace = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: trace.append(float(model.trainable_variables[0].numpy()[0, 0]))
    )
    callbacks = [hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2, warmup_epochs=1), record]
    history = model.fit(np.ones((2, 1), np.float32), np.zeros((2, 1), np.float32), batch_size=1, epochs=2,
                        shuffle=False, verbose=0, callbacks=callbacks)  # fmt: skip
    return {"w": trace, "lr_logs": [float(v) for v in history.history["lr"]]}


def deferred_build(rank, size):
    """Models Keras builds in their first step (a Sequential without Input, a subclassed model), w = 1 on rank
    0 and 0 on rank 1, SGD(0.1, momentum=0.9), broadcast from rank 0: `state` after one update."""
    init = "ones" if rank == 0 else "zeros"

    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, use_bias=False, kernel_initializer=init)

        def call(self, x):
            return self.dense(x)

    out = {}
    for name, model in (
        ("sequential", keras.Sequential([keras.layers.Dense(1, use_bias=False, kernel_initializer=init)])),
        ("subclassed", Subclassed()),
    ):
        model.compile(optimizer=DistributedOptimizer(SGD(0.1, momentum=0.9)), loss="mse", jit_compile=False)
        one_update(model, rank, [BroadcastGlobalVariablesCallback(0)])
        out[name] = state(model)
    return out


def rank0_loads(rank, size):
    """Rank 0 resumes from a .keras file (w = 1, momentum 0.5, 7 updates), whose variable paths differ from
    those of rank 1's model built in code (w = 0): `state` and the paths after one broadcast update."""
    path = os.path.join(OUT_DIR, "resume.keras")
    if rank == 0:
        keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])  # shifts the saved model's paths
        saved = one_weight_model(1.0)
        saved.compile(optimizer=DistributedOptimizer(SGD(0.1, momentum=0.9)), loss="mse")
        saved.optimizer.build(saved.trainable_variables)
        saved.optimizer.inner_optimizer.momentums[0].assign([[0.5]])
        saved.optimizer.inner_optimizer.iterations.assign(7)
        saved.save(path)
    collectives.allreduce_sum([0.0], name="barrier")
    if rank == 0:
        model = keras.models.load_model(path)
    else:
        model = one_weight_model(0.0)
        model.compile(optimizer=DistributedOptimizer(SGD(0.1, momentum=0.9)), loss="mse")
    paths = [v.path for v in model.trainable_variables]
    one_update(model, rank, [BroadcastGlobalVariablesCallback(0)])
    return {**state(model), "paths": paths}


def local_variables(rank, size):
    """w after one update from w = 1 (rank 0) and 0 (rank 1), the kernel local by register_local_var or by
    PartialDistributedOptimizer, and left out of BroadcastGlobalVariablesCallback (local_variables)."""
    out = {}
    for case in ("register_local_var", "partial"):
        model = one_weight_model(1.0 - rank)
        layer = model.layers[0]
        if case == "partial":
            optimizer = PartialDistributedOptimizer(SGD(0.1), local_layers=[layer])
        else:
            optimizer = DistributedOptimizer(SGD(0.1))
            optimizer.register_local_var(layer.kernel)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
        callback = BroadcastGlobalVariablesCallback(0, local_variables=[layer.kernel])
        out[case] = one_update(model, rank, [callback])
    return out


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
