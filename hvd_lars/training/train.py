"""The training loop: data-parallel `model.fit` with LARS (or momentum SGD) and a warmup schedule.

`run(config)` trains on every rank of a job of fixed size and returns the run summary (rank 0 writes it to
`<workdir>/<run_name>/summary.json`), in three steps read top to bottom: `start` (threads, seeds, model,
optimizer, the checkpoint to resume from), `callbacks_in_order` (one list, in the order Keras runs it) and
`fit`. Elastic jobs wrap the same steps from `hvd_lars.training.elastic`. Reads no flags.
"""

import dataclasses
import os

import keras
import tensorflow as tf

from hvd_lars.data import get_input
from hvd_lars.models import get_model
from hvd_lars.optim.rate_callbacks import LearningRateLogger
from hvd_lars.parallel import collectives
from hvd_lars.parallel.callbacks import MetricAverageCallback, broadcast_model_and_optimizer
from hvd_lars.training import epoch_logs, faults, recipe, threads
from hvd_lars.training.callbacks import ExactEvaluation, ImagesPerSecond
from hvd_lars.training.checkpoints import (
    CheckpointReadError,
    PeriodicCheckpoint,
    open_manager,
    restore_latest,
)
from hvd_lars.training.plan import make_plan, plan_changes, refuse_plan_changes
from hvd_lars.training.run_summary import RunSummary


@dataclasses.dataclass
class Job:
    """What one run keeps across its training attempts (one attempt for a fixed world size)."""

    config: object
    run_name: str
    run_dir: str
    model: keras.Model
    manager: tf.train.CheckpointManager
    requested_threads: tuple
    extra_callbacks: list
    signals: faults.StopSignals = dataclasses.field(default_factory=faults.StopSignals)
    watchdog: faults.ProgressWatchdog = None
    attempts: int = 0


def run(config, extra_callbacks=()):
    """Trains according to `config` on every rank; returns the summary dict.

    Args:
        config: `TrainConfig` (with `elastic` False; elastic jobs run `hvd_lars.training.elastic.run`).
        extra_callbacks: Keras callbacks run on every rank after evaluation and before the loggers
            (metrics.csv, TensorBoard, summary.json) and the epoch's checkpoint, so that what they add to the
            epoch logs is recorded.

    Raises:
        ValueError: bad configuration (before any data is read or model built), a run directory that is not
            writable or lacks the space for a few checkpoints, or a resume under another plan (every rank).
        FileNotFoundError: missing data.
        hvd_lars.training.faults.TrainingDiverged: a non-finite loss or weights on some rank (every rank
            raises it after the same update; summary.json records it).
        hvd_lars.training.faults.Preempted: SIGTERM or SIGUSR1 reached a rank; every rank stopped after the
            same update, whose checkpoint rank 0 wrote.
        hvd_lars.training.checkpoints.CheckpointWriteError: rank 0 could not write a checkpoint (every rank).
    """
    rank, world_size = collectives.init()
    config.validate(world_size)
    requested = threads.configure_threads(config, world_size)
    _, per_rank_batch = config.resolve_batch(world_size)
    run_name, run_dir = run_directory(config, world_size)
    data = get_input(config.dataset, **recipe.input_kwargs(config, per_rank_batch, rank, world_size, run_dir))
    job = start(config, run_name, run_dir, data, world_size, requested, extra_callbacks)
    # Rank 0's weights, optimizer slots and step counter become every rank's (not its dropout seed state),
    # before the step counter plans the rest of the run.
    broadcast_model_and_optimizer(job.model)
    with job.signals, job.watchdog:
        return attempt(job, data)


def run_directory(config, world_size):
    """(run name, run directory): `--run_name`, or a name made of the data set, model, optimizer and batch."""
    global_batch, _ = config.resolve_batch(world_size)
    run_name = config.run_name or f"{config.dataset}_{config.model}_{config.optimizer}_b{global_batch}"
    return run_name, os.path.join(config.workdir, run_name)


def start(config, run_name, run_dir, shapes, world_size, requested_threads, extra_callbacks=(), agree=True):
    """Seeds, precision, the compiled model with its built optimizer, and rank 0's restored checkpoint.

    Args:
        shapes: anything with `num_classes`, `input_shape` and `num_train_examples` (an `InputPipeline`,
            or the `hvd_lars.data.InputShapes` of `describe_input`).
        world_size: the world size the optimizer's plan is made for (1 for an elastic job's shapes).
        agree: rank 0's failure to read its checkpoints becomes every rank's error (a collective); False
            where no collective may run yet (before an elastic job's first sync).

    Returns:
        `Job`.
    """
    rank = collectives.rank()
    # Per-rank seeds: dropout masks differ across ranks (as each Caffe process had its own RNG); the initial
    # weights are rank 0's, broadcast before training. Input shuffling is seeded per rank in the pipeline.
    keras.utils.set_random_seed(config.seed + rank)
    plan = make_plan(config, world_size, shapes.num_train_examples)
    keras.mixed_precision.set_global_policy(plan.precision)
    model = get_model(config.model, num_classes=shapes.num_classes, input_shape=shapes.input_shape)
    optimizer = recipe.build_optimizer(config, plan)
    loss, metrics = recipe.loss_and_metrics(config, shapes.num_classes)
    # Horovod's collectives must stay outside XLA clusters (its XLA ops are not built).
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics, jit_compile=False)
    optimizer.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    manager = open_manager(checkpoint, os.path.join(run_dir, "checkpoints"), config.keep_checkpoints, run_dir)
    _resume(config, checkpoint, manager, run_dir, agree)
    return Job(
        config,
        run_name,
        run_dir,
        model,
        manager,
        requested_threads,
        list(extra_callbacks),
        watchdog=faults.ProgressWatchdog(config.hang_timeout_s),
    )


def _resume(config, checkpoint, manager, run_dir, agree):
    """Rank 0 restores the newest complete checkpoint (`restore_latest`: damaged ones are set aside, named).

    Raises:
        CheckpointReadError: checkpoints exist and none can be read back (on every rank with `agree`).
    """
    error = None
    if config.resume and collectives.is_chief():
        try:
            restored = restore_latest(checkpoint, manager, run_dir)
        except CheckpointReadError as e:
            error = str(e)
        else:
            if restored:
                step = int(checkpoint.optimizer.iterations)
                print(f"[hvd_lars] resumed from {restored} (step {step})", flush=True)
    if agree:
        error = collectives.broadcast_object(error, name="hvd_lars.resume")
    if error:
        raise CheckpointReadError(error)


def attempt(job, data, commit=None):
    """Trains from the optimizer's update count to the plan's end with the current world size.

    Args:
        job: `Job` from `start`.
        data: this rank's `InputPipeline` for the current rank and world size.
        commit: an elastic job's callback that commits its state, or None.

    Returns:
        the summary dict.
    """
    config, model, run_dir, chief = job.config, job.model, job.run_dir, collectives.is_chief()
    job.attempts += 1
    plan = make_plan(config, collectives.size(), data.num_train_examples)
    applied = threads.applied_threads(data.train)
    _announce(job, plan, applied)
    # Before anything is written: the run directory is writable and holds a few checkpoints.
    faults.check_run_dir(
        run_dir, faults.checkpoint_bytes(model.variables + model.optimizer.variables), config.keep_checkpoints
    )
    note = recipe.batch_norm_note(model, plan)
    if note and chief and job.attempts == 1:
        print(f"[hvd_lars] {note}", flush=True)
    start_step = int(model.optimizer.iterations)
    _check_same_plan(job, plan, start_step)
    if start_step >= plan.total_steps:
        if chief and job.attempts == 1:
            print(
                f"[hvd_lars] {run_dir} complete ({start_step} of {plan.total_steps} steps); nothing to do. "
                "Train again with another --run_name or --noresume.",
                flush=True,
            )
        return RunSummary.load(run_dir)
    summary = RunSummary(run_dir, job.run_name, config, plan, start_step, threads=applied)
    checkpointer = PeriodicCheckpoint(
        job.manager,
        config.checkpoint_every_steps,
        plan.accumulation_steps,
        at_epoch_end=config.checkpoint_at_epoch_end,
        asynchronous=config.async_checkpoints,
    )
    guard = faults.FaultGuard(job.signals, checkpointer, plan.accumulation_steps, plan.total_steps)
    callbacks = callbacks_in_order(job, data, plan, start_step, guard, checkpointer, summary, commit)
    try:
        fit(model, data, plan, config, callbacks, start_step)
    except (faults.TrainingDiverged, faults.Preempted) as e:
        summary.record_stop(type(e).__name__, e.step, str(e))
        raise
    if chief:
        _print_final(summary)
    return summary.summary


def callbacks_in_order(job, data, plan, start_step, guard, checkpointer, summary, commit=None):
    """The callbacks of one attempt, in the order Keras runs them at every batch and epoch end.

    Returns:
        list of `keras.callbacks.Callback`: the fault guard, the progress watchdog, rank averaging of the
        training metrics, images/s, the corrupt-image count (with `--skip_corrupt`), the learning rate, the
        evaluations, the caller's extra callbacks, the loggers (rank 0), summary.json, the checkpoint, the
        elastic commit (if any), and the guard's stop after an epoch's end.
    """
    config, chief = job.config, collectives.is_chief()
    evaluations = [ExactEvaluation(data.eval, data.num_eval_examples, config.eval_every_epochs, plan.epochs)]
    if data.validation is not None:
        # The held-out training images (--validation_examples), evaluated as the test set is, as val_*.
        evaluations.append(
            ExactEvaluation(
                data.validation, data.num_validation_examples, config.eval_every_epochs, plan.epochs, "val"
            )
        )
    loggers = []
    if chief:
        # Aligned in any evaluation schedule and across resumes (epoch_logs says why not Keras's own).
        loggers = [
            epoch_logs.MetricsCSV(os.path.join(job.run_dir, "metrics.csv"), start_step, plan.steps_per_epoch),
            epoch_logs.TensorBoardScalars(os.path.join(job.run_dir, "tensorboard"), start_step),
        ]
    return [
        guard,  # first: nothing of a diverged update is evaluated, logged, saved or committed
        job.watchdog,
        MetricAverageCallback(),  # every callback below sees rank-averaged training metrics
        *_corrupt_image_count(data),
        ImagesPerSecond(plan.per_rank_batch_size * collectives.size()),
        LearningRateLogger(),
        *evaluations,
        *job.extra_callbacks,
        *loggers,
        summary,
        checkpointer,  # after the loggers: no epoch's checkpoint exists without that epoch's logs
        *([commit] if commit is not None else []),  # after the checkpoint: what is committed was saved
        guard.after_epoch(),  # last: stops at the end of an epoch whose last update found a stop signal
    ]


def fit(model, data, plan, config, callbacks, step):
    """`model.fit` from update `step` to the plan's last. A run resumed mid-epoch first finishes that epoch,
    then runs the remaining whole epochs. The training stream is a function of the seed and the position,
    so starting it at the micro-batches already consumed puts every rank exactly where the interrupted run
    was, without reading or decoding any of them (InputPipeline.train_from). A callback that sets
    `model.stop_training` (Keras's EarlyStopping) ends training there."""
    micro_batches_per_epoch = plan.steps_per_epoch * plan.accumulation_steps
    verbose = config.verbose if collectives.is_chief() else 0
    while step < plan.total_steps:
        train = data.train_from(step * plan.accumulation_steps)
        if config.label_smoothing:
            train = train.map(lambda x, y, n=data.num_classes: (x, tf.one_hot(y, n)))
        epoch = step // plan.steps_per_epoch
        done_in_epoch = step - epoch * plan.steps_per_epoch
        model.fit(
            train,
            initial_epoch=epoch,
            epochs=plan.epochs if done_in_epoch == 0 else epoch + 1,
            steps_per_epoch=micro_batches_per_epoch - done_in_epoch * plan.accumulation_steps,
            callbacks=callbacks,
            verbose=verbose,
            shuffle=False,  # the tf.data pipeline shuffles each rank's shard itself
        )
        step = int(model.optimizer.iterations)
        if model.stop_training:
            break


def _corrupt_image_count(data):
    if data.skipped_corrupt is None:
        return []

    # Corrupt training files skipped (--skip_corrupt), summed over ranks, into the epoch logs.
    def count_skipped(epoch, logs):
        local = int(data.skipped_corrupt.numpy())
        logs["skipped_corrupt_images"] = float(collectives.allreduce_sum([local], "hvd_lars.skipped")[0])

    return [keras.callbacks.LambdaCallback(on_epoch_end=count_skipped)]


def _announce(job, plan, applied):
    """The plan and every rank's cores and threads in the run log (a collective: one gather)."""
    placements = collectives.gather_objects(
        {**threads.placement(), "host": os.uname().nodename, **applied}, name="hvd_lars.placement"
    )
    applied["cores_per_rank"] = [p["cores"] for p in placements]
    if not collectives.is_chief():
        return
    print(f"[hvd_lars] {plan.describe()}", flush=True)
    print(f"[hvd_lars] {threads.describe_placements(placements)}", flush=True)
    if (applied["intra_op"], applied["inter_op"]) != job.requested_threads:
        print(
            f"[hvd_lars] TensorFlow runs {applied['intra_op']} intra-op / {applied['inter_op']} inter-op "
            f"threads (0: its default), not the {job.requested_threads[0]} / {job.requested_threads[1]} "
            "asked "
            "for: it was initialised before hvd_lars could size its pools.",
            flush=True,
        )
    print(f"[hvd_lars] run directory {job.run_dir}", flush=True)


def _check_same_plan(job, plan, start_step):
    """Refuses, on every rank, to continue a checkpoint under another plan: rank 0 reads summary.json in the
    run's first attempt when it resumed. A collective in every attempt (a worker that joins an elastic job
    later is in its own first attempt while the others are not).

    Raises:
        ValueError: naming every setting that changed, with its saved and its new value.
    """
    message = None
    if collectives.is_chief() and start_step and job.attempts == 1:
        message = refuse_plan_changes(
            plan_changes(RunSummary.load(job.run_dir), job.config, plan), job.run_dir
        )
    # One rank's finding, every rank's error: the others would otherwise wait in the next collective.
    message = collectives.broadcast_object(message, name="hvd_lars.plan_check")
    if message:
        raise ValueError(message)


def _print_final(summary):
    result = summary.summary
    rate = f"{result['images_per_second']:.0f}" if result["images_per_second"] else "n/a"
    val = f"validation top-1 {result['final_val_top1']}, " if result["final_val_top1"] is not None else ""
    print(
        f"[hvd_lars] final test top-1 {result['final_test_top1']}, {val}{rate} images/s, "
        f"wall time {result['wall_time_s']:.0f} s; summary in {summary.path}",
        flush=True,
    )
