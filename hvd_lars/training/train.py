"""The training loop: data-parallel `model.fit` with LARS (or momentum SGD) and a warmup schedule.

`run(config)` trains on every rank of a job of fixed size and returns the run summary (rank 0 writes it to
`<workdir>/<run_name>/summary.json`), in steps read top to bottom: the plan (`make_plan`, once per attempt),
`start` (seeds, model, optimizer, the checkpoint to resume from or the new lineage), `callbacks_in_order`
(one list, in the order Keras runs it) and `fit`. Elastic jobs wrap the same steps from
`hvd_lars.training.elastic_loop`. Reads no flags.
"""

import dataclasses
import functools
import logging
import os

import keras
import tensorflow as tf

from hvd_lars.data import get_input
from hvd_lars.models import get_model
from hvd_lars.optim.rate_callbacks import LearningRateLogger
from hvd_lars.parallel import collectives
from hvd_lars.parallel.callbacks import MetricAverageCallback, broadcast_model_and_optimizer
from hvd_lars.training import epoch_logs, faults, recipe, threads
from hvd_lars.training.checkpoints import PeriodicCheckpoint, open_manager
from hvd_lars.training.config import TrainConfig
from hvd_lars.training.epoch_logs import ImagesPerSecond, Progress
from hvd_lars.training.evaluation import ExactEvaluation
from hvd_lars.training.lineage import Lineage, RunRecord
from hvd_lars.training.plan import batch_sizes, make_plan
from hvd_lars.training.resume import resume_or_begin
from hvd_lars.training.run_summary import RunSummary

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Job:
    """What one run keeps across its training attempts (one attempt for a fixed world size): the model
    with its optimizer, the checkpoint manager and the lineage rank 0 resumed or began. The plan is not
    here: each attempt makes its own (`make_plan`) and hands it down."""

    config: TrainConfig
    run_name: str
    run_dir: str
    model: keras.Model
    manager: tf.train.CheckpointManager
    lineage: Lineage
    record: RunRecord
    requested_threads: tuple
    extra_callbacks: list
    signals: faults.StopSignals
    watchdog: faults.ProgressWatchdog
    progress: Progress

    def agree(self):
        """Rank 0's lineage on every rank, in every rank's checkpoint record, and the progress record of the
        checkpoint it resumed from (a collective).

        Raises:
            ValueError: rank 0 refused the run directory's checkpoint (`Lineage.share`), on every rank.
        """
        self.lineage.share()
        self.record.assign(self.lineage.run_id)
        self.progress.resume(self.lineage.restored)


def run(config, extra_callbacks=()):
    """Trains according to `config` on every rank; returns the summary dict.

    Args:
        config: `TrainConfig` (with `elastic` False; elastic jobs run `hvd_lars.training.elastic_loop.run`).
        extra_callbacks: Keras callbacks run on every rank after evaluation and before the loggers
            (metrics.csv, TensorBoard, summary.json) and the epoch's checkpoint, so that what they add to the
            epoch logs is recorded.

    Raises:
        ValueError: bad configuration (before any data is read or model built), a run directory that is not
            writable, lacks the space for a few checkpoints or is in use by another job (`claim`), or a
            checkpoint of another plan or run (`hvd_lars.training.resume`; every rank).
        FileNotFoundError: missing data.
        hvd_lars.training.faults.TrainingDiverged: a non-finite loss or weights on some rank (every rank
            raises it after the same update; summary.json records it).
        hvd_lars.training.faults.Preempted: SIGTERM or SIGUSR1 reached a rank; every rank stopped after the
            same update, whose checkpoint rank 0 wrote.
        hvd_lars.training.faults.FileFailure: a write of the run or a read of its data failed on
            some rank (every rank).
    """
    rank, world_size = collectives.init()
    requested = threads.configure_threads(config, world_size)
    global_batch, per_rank_batch = batch_sizes(config, world_size)
    run_name, run_dir = run_directory(config, global_batch)
    faults.check_run_dir(run_dir, 0, 0)  # writable, before anything of the run is read or made
    with faults.RunDirClaim(run_dir):  # no second job on this directory, before anything is moved
        request = recipe.input_request(config, per_rank_batch, rank, world_size, run_dir)
        data = get_input(config.dataset, request, **recipe.input_options(config))
        plan = make_plan(config, world_size, data)
        signals, watchdog = faults.StopSignals(), faults.ProgressWatchdog(config.hang_timeout_s)
        job = start(config, plan, run_name, run_dir, data, requested, signals, watchdog, extra_callbacks)
        # Rank 0's weights, optimizer slots and step counter become every rank's (not its dropout seed
        # state), before the step counter plans the rest of the run.
        broadcast_model_and_optimizer(job.model)
        with job.signals, job.watchdog:
            return attempt(job, plan, data)


def run_directory(config, global_batch):
    """(run name, run directory): `--run_name`, or a name made of the data set, model, optimizer and the
    global batch."""
    run_name = config.run_name or f"{config.dataset}_{config.model}_{config.optimizer}_b{global_batch}"
    return run_name, os.path.join(config.workdir, run_name)


def start(
    config,
    plan,
    run_name,
    run_dir,
    shapes,
    requested_threads,
    signals,
    watchdog,
    extra_callbacks=(),
    agree=True,
):
    """Seeds, precision, the compiled model with its built optimizer, and the checkpoint rank 0 resumed
    from or the new lineage it began (`hvd_lars.training.resume.resume_or_begin`).

    Args:
        plan: the `Plan` the optimizer and its schedule are built for and the checkpoint is compared with
            (an elastic job's for 1 worker: its settings are those of any world size).
        shapes: anything with `num_classes` and `input_shape` (an `InputPipeline`, or the
            `hvd_lars.data.InputShapes` of `describe_input`).
        signals, watchdog: the `faults.StopSignals` and `faults.ProgressWatchdog` of the run.
        agree: rank 0's outcome becomes every rank's now (`Job.agree`, a collective); False where no
            collective may run yet (before an elastic job's first sync, which calls `Job.agree`).

    Returns:
        `Job`.

    Raises:
        ValueError: (with `agree`) rank 0 refused the run directory's checkpoint, on every rank.
    """
    rank = collectives.rank()
    # Per-rank seeds: dropout masks differ across ranks (as each Caffe process had its own RNG); the initial
    # weights are rank 0's, broadcast before training. Input shuffling is seeded per rank in the pipeline.
    keras.utils.set_random_seed(config.seed + rank)
    keras.mixed_precision.set_global_policy(plan.precision)
    model = get_model(config.model, num_classes=shapes.num_classes, input_shape=shapes.input_shape)
    optimizer = recipe.build_optimizer(config, plan)
    loss, metrics = recipe.loss_and_metrics(config, shapes.num_classes)
    # Horovod's collectives must stay outside XLA clusters (its XLA ops are not built).
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics, jit_compile=False)
    build = functools.partial(optimizer.build, model.trainable_variables)  # a no-op once built
    # Before the manager opens the folder: a fresh start moves an earlier run's checkpoints away first.
    lineage = Lineage()
    if collectives.is_chief():
        lineage = resume_or_begin(model, optimizer, build, run_dir, plan, config)
    build()
    record = RunRecord(plan.settings)
    progress = Progress(plan.steps_per_epoch)
    checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, run=record.variable, progress=progress.variable
    )
    manager = open_manager(checkpoint, os.path.join(run_dir, "checkpoints"), config.keep_checkpoints, run_dir)
    job = Job(
        config,
        run_name,
        run_dir,
        model,
        manager,
        lineage,
        record,
        requested_threads,
        list(extra_callbacks),
        signals,
        watchdog,
        progress,
    )
    if agree:
        job.agree()
    return job


def attempt(job, plan, data, commit=None):
    """Trains from the optimizer's update count to the plan's end with the current world size.

    Args:
        job: `Job` from `start`.
        plan: this attempt's `Plan` (`make_plan` for the current world size and `data`).
        data: this rank's `InputPipeline` for the current rank and world size.
        commit: an elastic job's callback that commits its state, or None.

    Returns:
        the summary dict.
    """
    config, model, run_dir, chief = job.config, job.model, job.run_dir, collectives.is_chief()
    model.train_function = None  # traced for this attempt's world size (an elastic job's changes)
    applied = threads.applied_threads(data.train)
    _announce(job, plan, applied)
    # Before anything is written: the run directory is writable and holds a few checkpoints.
    faults.check_run_dir(
        run_dir, faults.checkpoint_bytes(model.variables + model.optimizer.variables), config.keep_checkpoints
    )
    note = recipe.batch_norm_note(model, plan)
    if note and chief:
        log.info(note)
    start_step = int(model.optimizer.iterations)
    if start_step >= plan.total_steps:
        if chief:
            log.info(
                f"{run_dir} complete ({start_step} of {plan.total_steps} steps); nothing to do. Train again "
                "with another --run_name or --noresume."
            )
        return RunSummary.load(run_dir)
    summary = RunSummary(run_dir, job.run_name, config, plan, start_step, applied, job.lineage, job.progress)
    checkpointer = PeriodicCheckpoint(
        job.manager,
        config.checkpoint_every_steps,
        plan.accumulation_steps,
        at_epoch_end=config.checkpoint_at_epoch_end,
        asynchronous=config.async_checkpoints,
        progress=job.progress,
    )
    guard = faults.FaultGuard(job.signals, checkpointer, plan.accumulation_steps, plan.total_steps)
    callbacks = callbacks_in_order(job, data, plan, start_step, guard, checkpointer, summary, commit)
    try:
        fit(model, data, plan, config, callbacks, start_step)
    except (faults.TrainingDiverged, faults.Preempted) as e:
        summary.record_stop(type(e).__name__, e.step, str(e))
        raise
    summary.finish(job.manager.latest_checkpoint)
    return summary.summary


def callbacks_in_order(job, data, plan, start_step, guard, checkpointer, summary, commit=None):
    """The callbacks of one attempt, in the order Keras runs them at every batch and epoch end.

    Returns:
        list of `keras.callbacks.Callback`: the fault guard, the progress watchdog, rank averaging of the
        training metrics, images/s, the corrupt-image count (with `--skip_corrupt`), the learning rate, the
        evaluations, the caller's extra callbacks, the loggers (rank 0), summary.json, the checkpoint, the
        elastic commit (if any), the guard's stop after an epoch's end, and rank 0's lines.
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
            epoch_logs.MetricsCSV(
                os.path.join(job.run_dir, "metrics.csv"), start_step, plan.steps_per_epoch, job.lineage
            ),
            epoch_logs.TensorBoardScalars(os.path.join(job.run_dir, "tensorboard"), start_step, job.lineage),
        ]
    return [
        guard,  # first: nothing of a diverged update is evaluated, logged, saved or committed
        job.watchdog,
        job.progress,  # an epoch resumed mid-way starts from the metric sums of its earlier updates
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
        guard.after_epoch(),  # stops at the end of an epoch whose last update found a stop signal
        *_progress_lines(config, plan),
    ]


def _progress_lines(config, plan):
    """Rank 0's epoch and progress lines (`--verbose`, `--progress_every_s`); none on other ranks."""
    if not (config.verbose and collectives.is_chief()):
        return []
    images_per_batch = plan.per_rank_batch_size * collectives.size()
    every_s = config.progress_every_s if config.verbose == 1 else None
    batches = plan.steps_per_epoch * plan.accumulation_steps
    return [epoch_logs.EpochProgress(plan.epochs, batches, images_per_batch, every_s)]


def fit(model, data, plan, config, callbacks, step):
    """`model.fit` from update `step` to the plan's last. A run resumed mid-epoch first finishes that epoch,
    then runs the remaining whole epochs. The training stream is a function of the seed and the position,
    so starting it at the micro-batches already consumed puts every rank exactly where the interrupted run
    was, without reading or decoding any of them (InputPipeline.train_from). A callback that sets
    `model.stop_training` (Keras's EarlyStopping) ends training there."""
    micro_batches_per_epoch = plan.steps_per_epoch * plan.accumulation_steps
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
            verbose=0,  # rank 0's lines are the callbacks' (EpochProgress)
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
    log.info(plan.describe())
    log.info(threads.describe_placements(placements))
    if (applied["intra_op"], applied["inter_op"]) != job.requested_threads:
        log.info(
            f"TensorFlow runs {applied['intra_op']} intra-op / {applied['inter_op']} inter-op threads (0: "
            f"its default), not the {job.requested_threads[0]} / {job.requested_threads[1]} asked for: it "
            "was initialised before hvd_lars could size its pools."
        )
    log.info(f"run directory {job.run_dir}")
