"""One rank of the 2-rank tests of the Horovod glue (tests/test_distributed.py runs it through horovodrun).

A group runs many cases in one process group (one TensorFlow start-up per rank) and writes this rank's
results to <out>/<group>_rank<r>.npz, keyed "<case>/<what>"; the test compares the ranks, the references
and the hand-computed values. Models have no batch norm, so 2 ranks x B rows must give the updates of one
process on the 2B rows. Every case starts both ranks from the same weights, except the broadcast cases.

Usage: hvd_worker.py OUT_DIR GROUP     (GROUP: matrix, behaviour)
"""

import os
import sys

import numpy as np

STEPS = 3
GLOBAL_BATCH = 8
RATES = [0.05, 0.02, 0.04]  # per batch, for the "variable" cases (set by a callback before each batch)
OPTIMIZERS = ("sgd", "adam", "lamb", "lars")
RATE_KINDS = ("float", "variable", "schedule", "callable")
WRAPS = ("bare", "lso_inside", "lso_chosen")
CLIPNORM = 0.05  # SGD's global_clipnorm: the test checks the gradient norm exceeds it


def main(out_dir, group):
    from hvd_lars.parallel import collectives

    rank, size = collectives.init()
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # 2 ranks on 2 cores
    results = {}
    {"matrix": run_matrix, "behaviour": run_behaviour}[group](results, rank, size)
    os.makedirs(out_dir, exist_ok=True)
    np.savez(os.path.join(out_dir, f"{group}_rank{rank}.npz"), **results)


# ----------------------------------------------------------------------------------------------- shared


def _keras():
    import keras

    return keras


def data(rank, size, rows_per_step=GLOBAL_BATCH, seed=0):
    """(x, y) of this rank and of the whole job, step by step: rank r takes its slice of every step."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(STEPS, rows_per_step, 4)).astype(np.float32)
    y = rng.normal(size=(STEPS, rows_per_step, 2)).astype(np.float32)
    per_rank = rows_per_step // size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return (x[:, mine].reshape(-1, 4), y[:, mine].reshape(-1, 2)), (x.reshape(-1, 4), y.reshape(-1, 2))


def make_model(weights=None):
    keras = _keras()
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, activation="tanh", name="hidden"),
            keras.layers.Dense(2, name="out"),
        ]
    )
    if weights is not None:
        model.set_weights(weights)
    return model


def initial_weights():
    rng = np.random.default_rng(42)
    return [rng.normal(size=s, scale=0.5).astype(np.float32) for s in [(4, 3), (3,), (3, 2), (2,)]]


def fit(model, optimizer, x, y, batch_size, callbacks=(), epochs=1):
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))
    return model


def values(variables):
    return [np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in variables]


def record(results, case, name, arrays):
    for i, a in enumerate(arrays):
        results[f"{case}/{name}/{i}"] = np.asarray(a)


def _callable_rate():
    return 0.03


def make_optimizer(name, rate_kind, rate_variable=None, **kwargs):
    keras = _keras()
    from hvd_lars import LARS

    rate = {
        "float": 0.05,
        "variable": rate_variable if name == "lars" else 0.05,
        "schedule": keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5),
        "callable": _callable_rate,
    }[rate_kind]
    if name == "sgd":
        return keras.optimizers.SGD(rate, momentum=0.9, global_clipnorm=CLIPNORM, **kwargs)
    if name == "adam":
        return keras.optimizers.Adam(rate, weight_decay=0.01, **kwargs)
    if name == "lamb":
        return keras.optimizers.Lamb(rate, **kwargs)
    return LARS(rate, weight_decay=1e-3, eta=0.1, **kwargs)


def wrap(optimizer, kind, **kwargs):
    keras = _keras()
    from hvd_lars import DistributedOptimizer

    if kind == "bare":
        return DistributedOptimizer(optimizer, **kwargs)
    if kind == "lso_inside":
        return DistributedOptimizer(
            keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=64.0), **kwargs
        )
    return chosen_under_mixed_float16(lambda: DistributedOptimizer(optimizer, **kwargs))


def chosen_under_mixed_float16(make):
    """The optimizer `make()` returns while Keras's dtype policy is mixed_float16 (then float32 again):
    DistributedOptimizer chooses to scale the loss itself there."""
    keras = _keras()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return make()
    finally:
        keras.mixed_precision.set_global_policy("float32")


def set_rate_callback(rate_variable):
    keras = _keras()

    class SetRate(keras.callbacks.Callback):
        # A rate held in a variable and changed during training, as schedule callbacks do.
        def on_train_batch_begin(self, batch, logs=None):
            if rate_variable is not None:
                rate_variable.assign(RATES[batch])
            else:
                self.model.optimizer.learning_rate = RATES[batch]

    return SetRate()


# ----------------------------------------------------------------------------------------------- matrix


def run_matrix(results, rank, size):
    """SGD, Adam, Lamb, LARS x float rate, variable, schedule, callable x bare, inside a loss scaler,
    around a loss scaler: weights, optimizer state, and that state restored by tf.train.Checkpoint and
    by a .keras save and load."""
    keras = _keras()
    import tensorflow as tf

    keras.saving.register_keras_serializable(package="hvd_worker")(_callable_rate)
    (x, y), (x_all, y_all) = data(rank, size)
    w0 = initial_weights()
    scratch = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"hvd_worker_{os.getpid()}")
    for name in OPTIMIZERS:
        for rate_kind in RATE_KINDS:
            fresh_rate = lambda k=rate_kind: keras.Variable(0.05) if k == "variable" else None  # noqa: E731
            # One process on the whole batch, the plain optimizer.
            rate = fresh_rate()
            callbacks = (
                [set_rate_callback(rate if name == "lars" else None)] if rate_kind == "variable" else []
            )
            reference = fit(
                make_model(w0), make_optimizer(name, rate_kind, rate), x_all, y_all, GLOBAL_BATCH, callbacks
            )
            record(results, f"{name}/{rate_kind}", "reference", values(reference.trainable_variables))
            if name == "sgd":
                model = make_model(w0)
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(
                        keras.losses.mean_squared_error(y_all[:GLOBAL_BATCH], model(x_all[:GLOBAL_BATCH]))
                    )
                grads = tape.gradient(loss, model.trainable_variables)
                results[f"{name}/{rate_kind}/first_gradient_norm"] = np.asarray(tf.linalg.global_norm(grads))
            for kind in WRAPS:
                case = f"{name}/{rate_kind}/{kind}"
                rate = fresh_rate()
                callbacks = (
                    [set_rate_callback(rate if name == "lars" else None)] if rate_kind == "variable" else []
                )
                model = fit(
                    make_model(w0),
                    wrap(make_optimizer(name, rate_kind, rate), kind),
                    x,
                    y,
                    GLOBAL_BATCH // size,
                    callbacks,
                )
                optimizer = model.optimizer
                record(results, case, "final", values(model.trainable_variables))
                saved = values(optimizer.variables)
                record(results, case, "state", saved)
                results[f"{case}/iterations"] = np.asarray(int(optimizer.iterations))
                results[f"{case}/types"] = np.asarray(
                    [type(optimizer).__name__, type(optimizer.inner_optimizer).__name__]
                )
                # tf.train.Checkpoint into a freshly built model and optimizer of the same kind.
                path = os.path.join(scratch, case.replace("/", "_"))
                tf.train.Checkpoint(model=model, optimizer=optimizer).write(os.path.join(path, "ckpt"))
                fresh = make_model()
                fresh.compile(optimizer=wrap(make_optimizer(name, rate_kind, fresh_rate()), kind), loss="mse")
                fresh.optimizer.build(fresh.trainable_variables)
                tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).read(
                    os.path.join(path, "ckpt")
                ).assert_consumed()
                record(results, case, "checkpoint_state", values(fresh.optimizer.variables))
                model.save(os.path.join(path, "model.keras"))
                loaded = keras.models.load_model(os.path.join(path, "model.keras"))
                record(results, case, "keras_state", values(loaded.optimizer.variables))
                results[f"{case}/keras_type"] = np.asarray(type(loaded.optimizer).__name__)


# -------------------------------------------------------------------------------------------- behaviour


def run_behaviour(results, rank, size):
    keras = _keras()
    import tensorflow as tf

    from hvd_lars import DistributedOptimizer

    LSO = keras.optimizers.LossScaleOptimizer

    def scalar_steps(optimizer, grads_per_step):
        # Hand-made gradients of one scalar weight, applied in a tf.function as model.fit does.
        w = keras.Variable(0.0)
        optimizer.build([w])
        step = tf.function(lambda g: optimizer.apply([g], [w]))
        out = []
        for g in grads_per_step:
            step(tf.constant(g, tf.float32))
            out.append([float(w.numpy()), float(optimizer.dynamic_scale.numpy()), int(optimizer.iterations)])
        return np.asarray(out)

    # DistributedOptimizer(LossScaleOptimizer(SGD(1.0), initial_scale=4)), scaled gradients 8
    # and 0: the mean 4 unscales to 1, so w = -1 on both ranks.
    results["lso_inside/steps"] = scalar_steps(
        DistributedOptimizer(LSO(keras.optimizers.SGD(1.0), initial_scale=4)), [8.0 if rank == 0 else 0.0]
    )
    # Chosen under mixed_float16, the initial scale set before the build: inf on rank 0 and 8 on rank 1
    # -> the mean is inf, both skip, scale 4 -> 2; then 8 and 0 at scale 2 -> unscaled mean 2 -> w = -2.
    chosen = chosen_under_mixed_float16(lambda: DistributedOptimizer(keras.optimizers.SGD(1.0)))
    chosen.inner_optimizer.initial_scale = 4.0
    results["lso_chosen/steps"] = scalar_steps(
        chosen, [np.inf if rank == 0 else 8.0, 8.0 if rank == 0 else 0.0]
    )
    # A loss scaler around the wrapper (one that scales the loss or one that does not) would decide rank
    # by rank: refused when it is made.
    for case, inner in (
        ("around_plain", keras.optimizers.SGD(1.0)),
        ("two_scalers", LSO(keras.optimizers.SGD(1.0))),
    ):
        try:
            LSO(DistributedOptimizer(inner))
            results[f"{case}/error"] = np.asarray("")
        except ValueError as e:
            results[f"{case}/error"] = np.asarray(str(e))

    keras_built_loss_scaler(results, rank)
    accumulation(results, rank, size)
    reductions(results, rank, size)
    callbacks(results, rank, size)
    counts(results, rank)


def keras_built_loss_scaler(results, rank):
    """mixed_float16 set before the optimizer is made, as a Keras script does: DistributedOptimizer scales
    the loss itself, and model.compile leaves it as it is."""
    keras = _keras()
    from hvd_lars import DistributedOptimizer

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential(
            [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
        )
        model.compile(
            optimizer=DistributedOptimizer(keras.optimizers.SGD(1.0)), loss="mae", jit_compile=False
        )
        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)
        optimizer.dynamic_scale.assign(4.0)
        results["keras_built/types"] = np.asarray(
            [type(optimizer).__name__, type(optimizer.inner_optimizer).__name__]
        )
        rows = []
        # Step 1: rank 0's input is inf (its gradient is not finite), rank 1's gives 2 x scale 4 = 8.
        # Step 2: both give 2: the mean 2 at rate 1 moves the kernel to -2.
        for x in ([np.inf if rank == 0 else 2.0], [2.0]):
            model.fit(np.array([x], np.float32), np.array([[-1.0]], np.float32), batch_size=1, verbose=0)
            rows.append(
                [float(model.trainable_variables[0].numpy()[0, 0]), float(optimizer.dynamic_scale.numpy())]
            )
        results["keras_built/steps"] = np.asarray(rows)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def accumulation(results, rank, size):
    """2 ranks x 2 micro-batches of 2 rows against one process on the 8 rows of each update."""
    keras = _keras()
    from hvd_lars import LARS, DistributedOptimizer, WarmupPolynomialDecay

    LSO = keras.optimizers.LossScaleOptimizer
    (x, y), (x_all, y_all) = data(rank, size)
    w0 = initial_weights()
    schedule = lambda: WarmupPolynomialDecay(peak_learning_rate=0.5, total_steps=STEPS, warmup_steps=1)  # noqa: E731
    cases = {
        # Keras's own gradient_accumulation_steps, taken over by the wrapper.
        "sgd_adopted": (
            lambda: DistributedOptimizer(
                keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2)
            ),
            lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        ),
        "lars_schedule_lso_inside": (
            lambda: DistributedOptimizer(
                LSO(LARS(schedule(), eta=0.1), initial_scale=64.0), backward_passes_per_step=2
            ),
            lambda: LARS(schedule(), eta=0.1),
        ),
        "adam_lso_chosen": (
            lambda: chosen_under_mixed_float16(
                lambda: DistributedOptimizer(keras.optimizers.Adam(0.01), backward_passes_per_step=2)
            ),
            lambda: keras.optimizers.Adam(0.01),
        ),
    }
    for case, (distributed_one, plain) in cases.items():
        model = fit(make_model(w0), distributed_one(), x, y, GLOBAL_BATCH // size // 2)
        record(results, f"accumulation/{case}", "final", values(model.trainable_variables))
        wrapper = model.optimizer
        while type(wrapper).__name__ not in ("DistributedOptimizer", "DistributedLossScaleOptimizer"):
            wrapper = wrapper.inner_optimizer
        results[f"accumulation/{case}/counts"] = np.asarray(
            [int(model.optimizer.iterations), int(wrapper._iterations)]
        )
        reference = fit(make_model(w0), plain(), x_all, y_all, GLOBAL_BATCH)
        record(results, f"accumulation/{case}", "reference", values(reference.trainable_variables))

    # Ranks talk once per update: of the two branches of the traced update, only the one taken on an
    # update's last micro-batch holds allreduces.
    optimizer = DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2)
    variables = make_model(w0).trainable_variables
    optimizer.build(variables)
    graph = traced_update(optimizer, variables).graph.as_graph_def()
    functions = {f.signature.name: f for f in graph.library.function}
    branches = []
    for node in graph.node:
        if node.op in ("If", "StatelessIf"):
            for branch in ("then_branch", "else_branch"):
                body = functions[node.attr[branch].func.name]
                branches.append(sum(n.op == "HorovodAllreduce" for n in body.node_def))
    results["accumulation/allreduces_per_branch"] = np.asarray(branches)


def traced_update(optimizer, variables):
    """The graph of one `optimizer.apply` on float32 gradients of `variables` (traced, not run)."""
    import tensorflow as tf

    def update(*grads):
        optimizer.apply(list(grads), variables)

    return tf.function(update).get_concrete_function(*[tf.TensorSpec(v.shape, tf.float32) for v in variables])


def counts(results, rank):
    """`collectives.max_over_ranks`: the elastic loop's attempt count, where a rank that joined later
    (here rank 0) has seen fewer attempts than the others."""
    from hvd_lars.parallel import collectives

    results["counts/max"] = np.asarray(collectives.max_over_ranks(1 if rank == 0 else 3, name="t.counts"))


def reductions(results, rank, size):
    """Overlapped against grouped allreduce, without and with float16 compression."""
    keras = _keras()
    import tensorflow as tf

    from hvd_lars import DistributedOptimizer

    (x, y), _ = data(rank, size)
    # Rank-dependent scale: the ranks' gradients differ in magnitude, as float16 rounding then shows.
    y = y * (1.0 + 3.0 * rank)
    w0 = initial_weights()
    for reduction in ("overlap", "grouped"):
        for compression in ("none", "fp16"):
            case = f"reduction/{reduction}/{compression}"
            make = lambda r=reduction, c=compression: DistributedOptimizer(  # noqa: E731
                keras.optimizers.SGD(0.05, momentum=0.9), gradient_reduction=r, compression=c
            )
            model = fit(make_model(w0), make(), x, y, GLOBAL_BATCH // size)
            record(results, case, "final", values(model.trainable_variables))
            # The ops a traced update holds: per-tensor allreduces, or one grouped allreduce.
            optimizer = make()
            variables = make_model(w0).trainable_variables
            optimizer.build(variables)
            traced = traced_update(optimizer, variables)
            kinds = [op.type for op in traced.graph.get_operations()]
            halves = [
                op
                for op in traced.graph.get_operations()
                if op.type.startswith("Horovod") and op.inputs[0].dtype == tf.float16
            ]
            results[f"{case}/ops"] = np.asarray(
                [kinds.count("HorovodAllreduce"), kinds.count("HorovodGroupedAllreduce"), len(halves)]
            )


def callbacks(results, rank, size):
    keras = _keras()
    from hvd_lars import (
        BroadcastGlobalVariablesCallback,
        DistributedOptimizer,
        LearningRateWarmupCallback,
        MetricAverageCallback,
    )
    from hvd_lars.parallel.callbacks import average_metrics

    (x, y), _ = data(rank, size)
    # Broadcast: different initial weights per rank; after fit, rank 0's run on both.
    keras.utils.set_random_seed(10 + rank)
    model = make_model()
    results["broadcast/initial"] = np.asarray(model.get_weights()[0])
    fit(
        model,
        DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
        x,
        y,
        GLOBAL_BATCH // size,
        [BroadcastGlobalVariablesCallback(0)],
    )
    record(
        results,
        "broadcast",
        "first_fit",
        values(model.trainable_variables) + values(model.optimizer.variables),
    )
    # A resume that restored rank 0 only (here: weights moved, counter set to 100): the next fit starts
    # from rank 0's state on every rank.
    if rank == 0:
        for v in model.trainable_variables:
            v.assign(v + 1.0)
        model.optimizer.inner_optimizer.iterations.assign(100)
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH // size,
        shuffle=False,
        verbose=0,
        callbacks=[BroadcastGlobalVariablesCallback(0)],
    )
    record(
        results, "broadcast", "resumed", values(model.trainable_variables) + values(model.optimizer.variables)
    )
    results["broadcast/iterations"] = np.asarray(int(model.optimizer.iterations))

    # Metric averaging, val_* included: val_loss 1.0 on rank 0 and 3.0 on rank 1 (mean absolute error of
    # a zero model); EarlyStopping must see 2.0 on both.
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mae", jit_compile=False)
    target = 1.0 + 2.0 * rank
    stop = keras.callbacks.EarlyStopping(monitor="val_loss")
    history = model.fit(
        np.ones((2, 1), np.float32),
        np.full((2, 1), 10.0 * (rank + 1), np.float32),
        batch_size=2,
        epochs=2,
        verbose=0,
        validation_data=(np.ones((1, 1), np.float32), np.full((1, 1), target, np.float32)),
        callbacks=[MetricAverageCallback(), stop],
    )
    results["metric_average/best"] = np.asarray(stop.best)
    results["metric_average/val_loss"] = np.asarray(history.history["val_loss"])
    results["metric_average/loss"] = np.asarray(history.history["loss"])
    evaluated = model.evaluate(
        np.ones((1, 1), np.float32), np.full((1, 1), target, np.float32), verbose=0, return_dict=True
    )
    results["metric_average/evaluate"] = np.asarray(average_metrics(evaluated)["loss"])

    # Horovod's warmup from 0.4 / 2 to 0.4 over 2 epochs of 4 updates; at update 9 the user's own
    # callback sets 0.1, which the warmup callback (finished) leaves alone.
    keras = _keras()

    class Record(keras.callbacks.Callback):
        rates = []

        def on_train_batch_begin(self, batch, logs=None):
            self.rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations) == 10:
                self.model.optimizer.learning_rate = 0.1

    model = make_model(initial_weights())
    fit(
        model,
        DistributedOptimizer(keras.optimizers.SGD(0.0)),
        np.zeros((16, 4), np.float32),
        np.zeros((16, 2), np.float32),
        4,
        [LearningRateWarmupCallback(initial_lr=0.4, warmup_epochs=2), Record()],
        epochs=3,
    )
    results["warmup/rates"] = np.asarray(Record.rates)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
