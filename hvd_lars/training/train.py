"""The training loop: data-parallel `model.fit` with LARS (or momentum SGD) and a warmup schedule.

`run(config)` trains on every rank of a job of fixed size and returns the run summary, in steps read top
to bottom: the plan (`make_plan`, once per attempt), `start` (seeds, model, optimizer, the checkpoint to
resume from or the new lineage), `callbacks_in_order` (one list, in the order Keras runs it) and `fit`.
`run_elastic(config)` retries the same steps in Horovod's elastic loop after every membership change: the
global batch, the steps per epoch and the schedule stay; the per-rank batch adapts. Reads no flags.
"""

import dataclasses
import functools
import logging
import os

import keras
import tensorflow as tf

from hvd_lars.data import describe_input, get_input
from hvd_lars.models import get_model
from hvd_lars.optim.rate_callbacks import LearningRateLogger
from hvd_lars.parallel import collectives
from hvd_lars.parallel import elastic as hvd_elastic
from hvd_lars.parallel.callbacks import MetricAverageCallback, broadcast_model_and_optimizer
from hvd_lars.training import epoch_logs, faults, threads
from hvd_lars.training.checkpoints import (
    Lineage,
    PeriodicCheckpoint,
    RunRecord,
    open_manager,
    resume_or_begin,
)
from hvd_lars.training.config import TrainConfig
from hvd_lars.training.epoch_logs import ExactEvaluation, ImagesPerSecond, Progress, RunSummary
from hvd_lars.training.plan import (
    batch_norm_note,
    build_optimizer,
    input_options,
    input_request,
    loss_and_metrics,
    make_plan,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Run:
    """What a run resolves once, before its first attempt, and hands down: its settings, its run directory,
    the threads it asked TensorFlow for, its stop signals and hang watchdog, and the caller's callbacks."""

    config: TrainConfig
    run_name: str
    run_dir: str
    requested_threads: tuple
    signals: faults.StopSignals
    watchdog: faults.ProgressWatchdog
    extra_callbacks: list

    @classmethod
    def resolve(cls, config, global_batch, world_size, extra_callbacks=()):
        """The `Run` of `config` (threads sized for `world_size` ranks; the run directory named after
        `--run_name` or the data set, model, optimizer and `global_batch`)."""
        run_name = config.run_name or f"{config.dataset}_{config.model}_{config.optimizer}_b{global_batch}"
        return cls(
            config,
            run_name,
            os.path.join(config.workdir, run_name),
            threads.configure_threads(config, world_size),
            faults.StopSignals(),
            faults.ProgressWatchdog(config.hang_timeout_s),
            list(extra_callbacks),
        )


@dataclasses.dataclass
class Job:
    """What one run keeps across its training attempts (one attempt for a fixed world size): the `Run`, the
    model with its optimizer, the checkpoint manager and the lineage rank 0 resumed or began. The plan is
    not here: each attempt makes its own (`make_plan`) and hands it down."""

    run: Run
    model: keras.Model
    manager: tf.train.CheckpointManager
    lineage: Lineage
    record: RunRecord
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
        config: `TrainConfig` (with `elastic` False; elastic jobs run `run_elastic`).
        extra_callbacks: Keras callbacks run on every rank after evaluation and before the loggers
            (metrics.csv, TensorBoard, summary.json) and the epoch's checkpoint, so that what they add to the
            epoch logs is recorded.

    Raises:
        ValueError: bad configuration (before any data is read or model built), a run directory that is not
            writable, lacks the space for a few checkpoints or is in use by another job (`claim`), or a
            checkpoint of another plan or run (`hvd_lars.training.checkpoints`; every rank).
        FileNotFoundError: missing data.
        hvd_lars.training.faults.TrainingDiverged: a non-finite loss or weights on some rank (every rank
            raises it after the same update; summary.json records it).
        hvd_lars.training.faults.Preempted: SIGTERM or SIGUSR1 reached a rank; every rank stopped after the
            same update, whose checkpoint rank 0 wrote.
        hvd_lars.training.faults.FileFailure: a write of the run or a read of its data failed on
            some rank (every rank).
    """
    rank, world_size = collectives.init()
    global_batch, per_rank_batch = config.resolve_batch(world_size)
    run = Run.resolve(config, global_batch, world_size, extra_callbacks)
    faults.check_run_dir(run.run_dir, 0, 0)  # writable, before anything of the run is read or made
    with faults.RunDirClaim(run.run_dir):  # no second job on this directory, before anything is moved
        request = input_request(config, per_rank_batch, rank, world_size, run.run_dir)
        data = get_input(config.dataset, request, **input_options(config))
        plan = make_plan(config, world_size, data)
        job = start(run, plan, data)
        # Rank 0's weights, optimizer slots and step counter become every rank's (not its dropout seed
        # state), before the step counter plans the rest of the run.
        broadcast_model_and_optimizer(job.model)
        with run.signals, run.watchdog:
            return attempt(job, plan, data)


def start(run, plan, shapes, agree=True):
    """Seeds, precision, the compiled model with its built optimizer, and the checkpoint rank 0 resumed
    from or the new lineage it began (`hvd_lars.training.checkpoints.resume_or_begin`).

    Args:
        run: the `Run`.
        plan: the `Plan` the optimizer and its schedule are built for and the checkpoint is compared with
            (an elastic job's for 1 worker: its settings are those of any world size).
        shapes: anything with `num_classes` and `input_shape` (an `InputPipeline`, or the
            `hvd_lars.data.InputShapes` of `describe_input`).
        agree: rank 0's outcome becomes every rank's now (`Job.agree`, a collective); False where no
            collective may run yet (before an elastic job's first sync, which calls `Job.agree`).

    Returns:
        `Job`.

    Raises:
        ValueError: (with `agree`) rank 0 refused the run directory's checkpoint, on every rank.
    """
    config, rank = run.config, collectives.rank()
    # Per-rank seeds: dropout masks differ across ranks (as each Caffe process had its own RNG); the initial
    # weights are rank 0's, broadcast before training. Input shuffling is seeded per rank in the pipeline.
    keras.utils.set_random_seed(config.seed + rank)
    keras.mixed_precision.set_global_policy(plan.precision)
    model = get_model(config.model, num_classes=shapes.num_classes, input_shape=shapes.input_shape)
    optimizer = build_optimizer(config, plan)
    loss, metrics = loss_and_metrics(config, shapes.num_classes)
    # Horovod's collectives must stay outside XLA clusters (its XLA ops are not built).
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics, jit_compile=False)
    build = functools.partial(optimizer.build, model.trainable_variables)  # a no-op once built
    # Before the manager opens the folder: a fresh start moves an earlier run's checkpoints away first.
    lineage = Lineage()
    if collectives.is_chief():
        lineage = resume_or_begin(model, optimizer, build, run.run_dir, plan, config)
    build()
    record = RunRecord(plan.settings)
    progress = Progress(plan.steps_per_epoch)
    checkpoint = tf.train.Checkpoint(
        model=model, optimizer=optimizer, run=record.variable, progress=progress.variable
    )
    folder = os.path.join(run.run_dir, "checkpoints")
    manager = open_manager(checkpoint, folder, config.keep_checkpoints, run.run_dir)
    job = Job(run, model, manager, lineage, record, progress)
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
    config, model, run_dir, chief = job.run.config, job.model, job.run.run_dir, collectives.is_chief()
    model.train_function = None  # traced for this attempt's world size (an elastic job's changes)
    applied = threads.applied_threads(data.train)
    _announce(job, plan, applied)
    # Before anything is written: the run directory is writable and holds a few checkpoints.
    faults.check_run_dir(
        run_dir, faults.checkpoint_bytes(model.variables + model.optimizer.variables), config.keep_checkpoints
    )
    note = batch_norm_note(model, plan)
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
    summary = RunSummary(run_dir, config, plan, start_step, applied, job)
    callbacks = callbacks_in_order(job, data, plan, summary, commit)
    try:
        fit(model, data, plan, config, callbacks, start_step)
    except (faults.TrainingDiverged, faults.Preempted) as e:
        summary.record_stop(type(e).__name__, e.step, str(e))
        raise
    summary.finish(job.manager.latest_checkpoint)
    return summary.summary


def callbacks_in_order(job, data, plan, summary, commit=None):
    """The callbacks of one attempt, in the order Keras runs them at every batch and epoch end, from the
    optimizer's update count on.

    Returns:
        list of `keras.callbacks.Callback`: the fault guard, the progress watchdog, rank averaging of the
        training metrics, images/s, the corrupt-image count (with `--skip_corrupt`), the learning rate, the
        evaluations, the caller's extra callbacks, the loggers (rank 0), summary.json, the checkpoint, the
        elastic commit (if any), the guard's stop after an epoch's end, and rank 0's lines.
    """
    config, chief, start_step = job.run.config, collectives.is_chief(), int(job.model.optimizer.iterations)
    checkpointer = PeriodicCheckpoint(
        job.manager,
        config.checkpoint_every_steps,
        plan.accumulation_steps,
        at_epoch_end=config.checkpoint_at_epoch_end,
        asynchronous=config.async_checkpoints,
        progress=job.progress,
    )
    guard = faults.FaultGuard(job.run.signals, checkpointer, plan.accumulation_steps, plan.total_steps)
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
                os.path.join(job.run.run_dir, "metrics.csv"), start_step, plan.steps_per_epoch, job.lineage
            ),
            epoch_logs.TensorBoardScalars(
                os.path.join(job.run.run_dir, "tensorboard"), start_step, job.lineage
            ),
        ]
    return [
        guard,  # first: nothing of a diverged update is evaluated, logged, saved or committed
        job.run.watchdog,
        job.progress,  # an epoch resumed mid-way starts from the metric sums of its earlier updates
        MetricAverageCallback(),  # every callback below sees rank-averaged training metrics
        *_corrupt_image_count(data),
        ImagesPerSecond(plan.per_rank_batch_size * collectives.size()),
        LearningRateLogger(),
        *evaluations,
        *job.run.extra_callbacks,
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
    requested = job.run.requested_threads
    if (applied["intra_op"], applied["inter_op"]) != requested:
        log.info(
            f"TensorFlow runs {applied['intra_op']} intra-op / {applied['inter_op']} inter-op threads (0: "
            f"its default), not the {requested[0]} / {requested[1]} asked for: it was initialised before "
            "hvd_lars could size its pools."
        )
    log.info(f"run directory {job.run.run_dir}")


try:  # Horovod's framework-neutral elastic state (what its elastic loop drives)
    from horovod.common.elastic import State as _State
except ImportError:  # pragma: no cover - Horovod is part of this project's environment
    _State = object


class ElasticBatchError(ValueError):
    """The workers of an elastic job cannot share the plan's global batch evenly."""


def run_elastic(config, extra_callbacks=()):
    """Trains according to `config` (with `elastic` True) while workers leave and join; returns the summary.

    No collective comes before the elastic loop's first sync: a worker that joins later runs this code
    while the others wait in that sync. So rank 0 alone describes the input before the loop
    (`hvd_lars.data.describe_input`: the image shape, the classes and the training examples, read
    without building the input; an image folder is listed once, by rank 0, or read from the run's
    listing index), and the description is the first thing every sync broadcasts (`_JobState`): each
    rank builds its model, optimizer and plan from rank 0's description at its first sync, the joining
    worker's included, then takes rank 0's variables. Each attempt builds this rank's shard for the
    world size of the moment and re-traces the training step, whose graph holds the last world size's
    decisions (no allreduce at all with one rank).

    Raises:
        ValueError: not launched by an elastic launcher, no `--global_batch_size`, or any error of
            `hvd_lars.training.train.run`.
        ElasticBatchError: a new worker count does not divide the global batch (every rank, at the change).
    """
    # Horovod's response cache lets each rank fuse cached tensors by its own fusion threshold, which an
    # elastic reset leaves different on the re-initialised ranks (results/faults.md, "worker joining"):
    # off, rank 0 alone decides every message. Read by Horovod at init; a value exported is kept.
    os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
    collectives.init()
    check_launched(config)
    # The world size is checked against the global batch in each attempt, on every rank together.
    run = Run.resolve(config, config.global_batch_size, collectives.size(), extra_callbacks)
    shapes = _described_by_rank_0(run)

    def build(shapes):
        # The optimizer and the checkpoint's plan from the plan for 1 worker: the global batch, the steps
        # and the schedule are the same for every worker count that divides the global batch.
        job = start(run, make_plan(config, 1, shapes), shapes, agree=False)
        faults.heartbeat()  # building the model is this rank's progress while the others wait
        return job

    state = _JobState(shapes, build)
    state.attempts = 0
    with run.signals, run.watchdog:
        return hvd_elastic.run(functools.partial(_elastic_attempt, run))(state)


def _described_by_rank_0(run):
    """Rank 0's `InputShapes` of the run's data (or the error it met, which every rank raises at the first
    sync rather than wait for a rank 0 gone); None on the other ranks."""
    if not collectives.is_chief():
        return None
    config = run.config
    try:
        problem = faults.run_dir_problem(run.run_dir, 0)
        if problem:
            raise ValueError(problem)
        request = input_request(config, config.global_batch_size, 0, 1, run.run_dir)
        return describe_input(config.dataset, request, **input_options(config))
    except (ValueError, OSError) as e:
        return e


def _elastic_attempt(run, state):
    """One attempt of an elastic job at the world size of the moment."""
    config, rank, world_size = run.config, collectives.rank(), collectives.size()
    resolve_batch(config, world_size)  # ElasticBatchError, naming the worker counts that fit
    plan = make_plan(config, world_size, state.shapes)
    request = input_request(config, plan.per_rank_batch_size, rank, world_size, run.run_dir)
    data = get_input(config.dataset, request, **input_options(config))
    # The largest count of any rank, so that the number goes on when rank 0 is a worker that joined
    # later, or when the old rank 0 is gone.
    state.attempts = collectives.max_over_ranks(state.attempts + 1, name="hvd_lars.elastic.attempt")
    if collectives.is_chief():
        log.info(
            f"elastic attempt {state.attempts}: {world_size} worker(s) from update "
            f"{int(state.job.model.optimizer.iterations)}, {plan.per_rank_batch_size} images per rank per "
            f"micro-batch (global batch {plan.global_batch_size})"
        )
    commit = hvd_elastic.CommitState(state, config.elastic_commit_every_steps)
    return attempt(state.job, plan, data, commit=commit)


class _JobState(_State):
    """The elastic state of the main program's job, whose model is built at its first sync.

    `sync()` broadcasts rank 0's `InputShapes` first (the first collective of every start and restart,
    the same on a worker that joins as on those that wait for it), builds the job from them on a rank
    that has none yet (`build(shapes)` -> `Job`), gives every rank rank 0's lineage or its refusal
    of the run directory's checkpoint (`Job.agree`), then syncs the model and optimizer
    (`hvd_lars.parallel.elastic.KerasState`, with the update count as `step`). Commits, restores and
    resets go to that `KerasState`; host updates are checked by this object, the one the loop listens to.

    Args:
        shapes: rank 0's `InputShapes`, or the error describing the input raised there (every rank
            raises it at the sync); None on the other ranks.
        build: callable(`InputShapes`) -> `Job`.
    """

    def __init__(self, shapes, build):
        super().__init__(
            bcast_object=lambda value: collectives.broadcast_object(value, name="hvd_lars.elastic.hosts"),
            get_rank=collectives.rank,
        )
        self.shapes, self._build = shapes, build
        self.job = self.keras = None

    @property
    def step(self):
        return self.keras.step

    @step.setter
    def step(self, value):
        self.keras.step = value

    def sync(self):
        self.shapes = collectives.broadcast_object(self.shapes, name="hvd_lars.elastic.shapes")
        if isinstance(self.shapes, Exception):
            raise self.shapes
        if self.shapes is None:
            raise RuntimeError("elastic sync: rank 0 holds no description of the input (it joined late?).")
        if self.job is None:
            self.job = self._build(self.shapes)
            self.keras = hvd_elastic.KerasState(self.job.model, step=int(self.job.model.optimizer.iterations))
        self.job.agree()  # rank 0's lineage (or its refusal of the checkpoint) on every rank
        self.keras.sync()

    def save(self):
        self.keras.save()

    def restore(self):
        if self.keras is not None:  # a failure before the first sync finished: nothing committed yet
            self.keras.restore()

    def reset(self):
        if self.keras is not None:
            self.keras.reset()


def check_launched(config, environ=None):
    """Refuses `--elastic` outside an elastic launcher, or without a fixed global batch.

    Raises:
        ValueError: HOROVOD_ELASTIC is not "1" (not started by `horovodrun --min-np/--max-np ...
            --host-discovery-script`), or only `--per_rank_batch_size` is given (the global batch would
            change with the worker count; the plan must not).
    """
    environ = os.environ if environ is None else environ
    if environ.get("HOROVOD_ELASTIC") != "1":
        raise ValueError(
            "--elastic needs an elastic launcher: horovodrun -np N --min-np MIN --max-np MAX "
            "--host-discovery-script SCRIPT (launch/elastic.sh); HOROVOD_ELASTIC is "
            f"{environ.get('HOROVOD_ELASTIC')!r}, not '1'."
        )
    if not config.global_batch_size:
        raise ValueError(
            f"--elastic needs --global_batch_size (got 0 with --per_rank_batch_size="
            f"{config.per_rank_batch_size}): the global batch and the schedule stay the plan's whatever the "
            "number of workers, and the per-rank batch follows from them."
        )


def resolve_batch(config, world_size):
    """(global batch, per-rank batch) for `world_size` workers: `TrainConfig.resolve_batch`, with an error
    that says it is the elastic job's new worker count that does not fit.

    Raises:
        ElasticBatchError: global batch % (world size x accumulation steps) != 0, naming the three
            figures and the worker counts that would divide it.
    """
    try:
        return config.resolve_batch(world_size)
    except ValueError as e:
        divisor = config.accumulation_steps
        fits = [n for n in range(1, 65) if config.global_batch_size % (n * divisor) == 0]
        raise ElasticBatchError(
            f"the elastic job now has {world_size} workers, and the global batch of "
            f"{config.global_batch_size} images does not divide by {world_size} workers x "
            f"{divisor} accumulation steps. The plan's global batch does not change with the workers; "
            f"worker counts that divide it: {', '.join(map(str, fits))}. Give the discovery script such "
            f"counts (or --max-np), or choose a global batch that they divide. ({e})"
        ) from e
