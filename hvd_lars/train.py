"""The training loop: data-parallel `model.fit` with LARS (or momentum SGD) and a warmup schedule.

`run(config)` trains on every rank of the job and returns the run summary (also written by rank 0 to
`<workdir>/<run_name>/summary.json`). Library code: reads no flags.
"""

import json
import os
import time

from hvd_lars import distributed
from hvd_lars.config import make_plan


def configure_threads(config, world_size):
    """Sizes TensorFlow's thread pools so the ranks on one node do not oversubscribe its cores.

    Must run before TensorFlow executes its first op.
    """
    import tensorflow as tf

    local_ranks = max(
        1,
        min(
            world_size,
            int(
                os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("HOROVOD_LOCAL_SIZE", world_size))
            ),
        ),
    )
    intra = config.intra_op_threads or max(1, (os.cpu_count() or 1) // local_ranks)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        if config.inter_op_threads:
            tf.config.threading.set_inter_op_parallelism_threads(config.inter_op_threads)
    except RuntimeError:
        pass  # TensorFlow already initialised by the caller: keep its settings.


def build_optimizer(config, plan):
    """LARS or momentum SGD on the warmup + polynomial-decay schedule of `plan`."""
    from hvd_lars.lars import LARS
    from hvd_lars.schedules import WarmupPolynomialDecay

    schedule = WarmupPolynomialDecay(
        peak_learning_rate=plan.peak_learning_rate,
        total_steps=plan.total_steps,
        warmup_steps=plan.warmup_steps,
        warmup_start_learning_rate=config.warmup_start_learning_rate,
        end_learning_rate=config.end_learning_rate,
        power=config.decay_power,
    )
    if config.optimizer == "lars":
        return LARS(
            schedule,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
            eta=config.eta,
            epsilon=config.epsilon,
        )
    # Momentum SGD with L2 weight decay added to the gradient (coupled), as in Caffe and Goyal et al.:
    # exactly LARS with every tensor left out of layer adaptation (trust ratio 1).
    return LARS(
        schedule,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        exclude_from_layer_adaptation=[""],
        name="momentum_sgd",
    )


def run(config):
    """Trains according to `config` on every rank; returns the summary dict.

    Raises:
        ValueError: bad configuration (before any data is read or model built).
        FileNotFoundError: missing data.
    """
    rank, world_size = distributed.init()
    config.validate(world_size)
    configure_threads(config, world_size)

    import keras
    import tensorflow as tf

    from hvd_lars import callbacks as cb
    from hvd_lars import provenance
    from hvd_lars.data import get_input
    from hvd_lars.models import get_model

    keras.utils.set_random_seed(config.seed)
    chief = distributed.is_chief()
    run_name = (
        config.run_name or f"{config.dataset}_{config.model}_{config.optimizer}_b{config.global_batch_size}"
    )
    run_dir = os.path.join(config.workdir, run_name)

    data = get_input(
        config.dataset,
        per_rank_batch=config.global_batch_size // world_size,
        rank=rank,
        world_size=world_size,
        seed=config.seed,
        data_dir=config.data_dir or None,
        max_train_examples=config.max_train_examples,
        max_eval_examples=config.max_eval_examples,
    )
    plan = make_plan(config, world_size, data.num_train_examples)
    if chief:
        print(f"[hvd_lars] {plan.describe()}", flush=True)
        print(f"[hvd_lars] run directory {run_dir}", flush=True)
        os.makedirs(run_dir, exist_ok=True)

    model = get_model(config.model, num_classes=data.num_classes, input_shape=data.input_shape)
    optimizer = distributed.distributed_optimizer(build_optimizer(config, plan))
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            keras.metrics.SparseCategoricalAccuracy(name="top1"),
            keras.metrics.SparseTopKCategoricalAccuracy(k=5, name="top5"),
        ],
        # Horovod's collectives must stay outside XLA clusters (its XLA ops are not built).
        jit_compile=False,
    )
    optimizer.build(model.trainable_variables)

    epoch_variable = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch_variable)
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(run_dir, "checkpoints"), max_to_keep=3)
    if config.resume and chief and manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).expect_partial()
        print(
            f"[hvd_lars] resumed from {manager.latest_checkpoint} (epoch {int(epoch_variable.numpy())})",
            flush=True,
        )
    # Rank 0's weights, optimizer slots, step counter and epoch become every rank's.
    distributed.broadcast_variables(model.variables + optimizer.variables + [epoch_variable])
    initial_epoch = int(epoch_variable.numpy())

    callbacks = [
        cb.AverageOverRanks(),
        cb.ImagesPerSecond(plan.global_batch_size, plan.steps_per_epoch),
        cb.LearningRateLogger(),
        cb.ExactEvaluation(data.eval, data.num_eval_examples, every_epochs=1, last_epoch=plan.epochs),
        cb.CheckpointEveryEpoch(manager, epoch_variable),
    ]
    if chief:
        callbacks += [
            keras.callbacks.CSVLogger(os.path.join(run_dir, "metrics.csv"), append=initial_epoch > 0),
            keras.callbacks.TensorBoard(os.path.join(run_dir, "tensorboard"), update_freq="epoch"),
        ]
    start = time.perf_counter()
    history = model.fit(
        data.train,
        epochs=plan.epochs,
        initial_epoch=initial_epoch,
        steps_per_epoch=plan.steps_per_epoch,
        callbacks=callbacks,
        verbose=config.verbose if chief else 0,
        shuffle=False,  # the tf.data pipeline shuffles each rank's shard itself
    )
    wall_time = time.perf_counter() - start

    epochs = [
        {"epoch": initial_epoch + i + 1, **{k: float(v[i]) for k, v in history.history.items()}}
        for i in range(len(history.epoch))
    ]
    # The first epoch includes graph tracing; the steady rate leaves it out when there are others.
    steady = [e["images_per_second"] for e in epochs[1:]] or [e["images_per_second"] for e in epochs]
    summary = {
        "run_name": run_name,
        "config": vars(config),
        "plan": vars(plan),
        "world_size": world_size,
        "global_batch_size": plan.global_batch_size,
        "per_rank_batch_size": plan.per_rank_batch_size,
        "images_per_second": sum(steady) / len(steady) if steady else None,
        "wall_time_s": wall_time,
        "final_test_top1": epochs[-1].get("test_top1") if epochs else None,
        "final_test_top5": epochs[-1].get("test_top5") if epochs else None,
        "epochs": epochs,
        **provenance.record(),
    }
    if chief:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(
            f"[hvd_lars] final test top-1 {summary['final_test_top1']}, "
            f"{summary['images_per_second']:.0f} images/s, wall time {wall_time:.0f} s; "
            f"summary in {run_dir}/summary.json",
            flush=True,
        )
    return summary
