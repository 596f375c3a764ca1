"""The training loop: data-parallel `model.fit` with LARS (or momentum SGD) and a warmup schedule.

`run(config)` trains a job of fixed size, top to bottom: the plan (`make_plan`), `start` (seeds, model,
optimizer, the checkpoint to resume from), `attempt`, whose `callbacks_in_order` and `fit` train to the
plan's end. `run_elastic(config)` shares the preface (`Run.resolve`) and retries `attempt` in Horovod's
elastic loop after every membership change: the global batch, steps and schedule stay; the per-rank batch
adapts (docs/design.md, "The loop").
"""

import dataclasses
import functools
import logging
import os

import keras
import tensorflow as tf
from horovod.common.elastic import State

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
from hvd_lars.training.epoch_logs import ExactEvaluation, Progress, RunSummary
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
    """What a run resolves once, before its first attempt: its settings, run directory, the threads asked
    of TensorFlow, its stop signals and hang watchdog, and the caller's callbacks."""

    config: TrainConfig
    run_dir: str
    requested_threads: tuple
    signals: faults.StopSignals
    watchdog: faults.ProgressWatchdog
    extra_callbacks: list

    @classmethod
    def resolve(cls, config, global_batch, world_size, extra_callbacks=()):
        """The run directory is `--run_name`, or named after the data, model, optimizer and global batch."""
        run_name = config.run_name or f"{config.dataset}_{config.model}_{config.optimizer}_b{global_batch}"
        return cls(
            config,
            os.path.join(config.workdir, run_name),
            threads.configure_threads(config, world_size),
            faults.StopSignals(),
            faults.ProgressWatchdog(config.hang_timeout_s),
            list(extra_callbacks),
        )


@dataclasses.dataclass
class Job:
    """What a run keeps across its attempts: the `Run`, the model with its optimizer, the checkpoint manager,
    the lineage rank 0 resumed or began, the checkpoint's run record and progress record."""

    run: Run
    model: keras.Model
    manager: tf.train.CheckpointManager
    lineage: Lineage
    record: RunRecord
    progress: Progress

    def agree(self):
        """Rank 0's lineage and resumed progress on every rank (a collective); a ValueError on every rank
        where rank 0 refused the run directory's checkpoint."""
        self.lineage.share()
        self.record.assign(self.lineage.run_id)
        self.progress.resume(self.lineage.restored)


def run(config, extra_callbacks=()):
    """Trains according to `config` (not elastic) on every rank; returns the summary dict.

    `extra_callbacks` run on every rank after evaluation and before the loggers and the checkpoint, so
    what they add to the epoch logs is recorded.

    Raises:
        ValueError: bad configuration, a run directory that is not writable, lacks the space for a few
            checkpoints or is in use by another job, or holds a checkpoint of another plan or run.
        FileNotFoundError: missing data.
        hvd_lars.training.faults.TrainingDiverged, Preempted, FileFailure: on every rank, after the same
            update (docs/faults.md).
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
        # Rank 0's weights, slots and step counter on every rank (not its dropout seed state).
        broadcast_model_and_optimizer(job.model)
        with run.signals, run.watchdog:
            return attempt(job, plan, data)


def start(run, plan, shapes, agree=True):
    """Seeds, precision, the compiled model with its built optimizer for `plan`, and the checkpoint rank 0
    resumed from or the lineage it began (`checkpoints.resume_or_begin`); returns the `Job`.

    `shapes` has `num_classes` and `input_shape`. `agree`: share rank 0's outcome now (`Job.agree`); False
    where no collective may run yet (before an elastic job's first sync).
    """
    config, rank = run.config, collectives.rank()
    # Per-rank seeds: dropout masks differ across ranks; the initial weights are rank 0's, broadcast later.
    keras.utils.set_random_seed(config.seed + rank)
    keras.mixed_precision.set_global_policy(plan.precision)
    model = get_model(config.model, num_classes=shapes.num_classes, input_shape=shapes.input_shape)
    optimizer = build_optimizer(config, plan)
    loss, metrics = loss_and_metrics(config, shapes.num_classes)
    # Horovod's collectives must stay outside XLA clusters (its XLA ops are not built).
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics, jit_compile=False)
    build = functools.partial(optimizer.build, model.trainable_variables)  # a no-op once built
    lineage = Lineage()
    if collectives.is_chief():  # before the manager opens the folder: a fresh start moves old files away
        lineage = resume_or_begin(model, optimizer, build, run.run_dir, plan, config)
    build()
    record, progress = RunRecord(plan.settings), Progress(plan)
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
    """Trains from the optimizer's update count to the plan's end at this world size (`plan`, this rank's
    `data`); `commit`: an elastic job's commit callback. Returns the summary dict."""
    config, model, run_dir, chief = job.run.config, job.model, job.run.run_dir, collectives.is_chief()
    model.train_function = None  # traced for this attempt's world size
    applied = threads.applied_threads(data.train)
    _announce(job, plan, applied)
    # Before anything is written: the run directory is writable and holds a few checkpoints.
    variables = model.variables + model.optimizer.variables
    faults.check_run_dir(run_dir, faults.checkpoint_bytes(variables), config.keep_checkpoints)
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
    summary = RunSummary(run_dir, config, plan, start_step, applied, job.progress)
    callbacks = callbacks_in_order(job, data, plan, summary, commit)
    try:
        fit(model, data, plan, config, callbacks, start_step)
    except (faults.TrainingDiverged, faults.Preempted) as e:
        summary.record_stop(type(e).__name__, e.step, str(e))
        raise
    summary.finish(job.manager.latest_checkpoint)
    return summary.summary


def callbacks_in_order(job, data, plan, summary, commit=None):
    """The callbacks of one attempt, in the order Keras runs them (docs/design.md, "The loop")."""
    config, chief, start_step = job.run.config, collectives.is_chief(), int(job.model.optimizer.iterations)
    run_dir, every, images_per_batch = job.run.run_dir, config.eval_every_epochs, plan.per_rank_batch_size
    images_per_batch *= collectives.size()
    checkpointer = PeriodicCheckpoint(
        job.manager,
        config.checkpoint_every_steps,
        plan.accumulation_steps,
        at_epoch_end=config.checkpoint_at_epoch_end,
        asynchronous=config.async_checkpoints,
        progress=job.progress,
    )
    guard = faults.FaultGuard(job.run.signals, checkpointer, plan.accumulation_steps, plan.total_steps)
    evaluations = [ExactEvaluation(data.eval, data.num_eval_examples, every, plan.epochs)]
    if data.validation is not None:  # the held-out training images (--validation_examples), as val_*
        evaluations.append(
            ExactEvaluation(data.validation, data.num_validation_examples, every, plan.epochs, "val")
        )
    loggers, lines = [], []
    if chief:
        loggers = [
            epoch_logs.MetricsCSV(os.path.join(run_dir, "metrics.csv"), start_step),
            epoch_logs.TensorBoardScalars(os.path.join(run_dir, "tensorboard")),
        ]
    if chief and config.verbose:
        every_s = config.progress_every_s if config.verbose == 1 else None
        batches = plan.steps_per_epoch * plan.accumulation_steps
        lines = [epoch_logs.EpochProgress(plan.epochs, batches, images_per_batch, every_s)]
    return [
        guard,  # first: nothing of a diverged update is evaluated, logged, saved or committed
        job.run.watchdog,
        job.progress,  # an epoch resumed mid-way starts from its earlier updates' metric sums; images/s
        MetricAverageCallback(),  # every callback below sees rank-averaged training metrics
        *_skipped_corrupt(data),
        LearningRateLogger(),
        *evaluations,
        *job.run.extra_callbacks,
        *loggers,
        summary,
        checkpointer,  # after the loggers: no epoch's checkpoint exists without that epoch's logs
        *([commit] if commit is not None else []),  # after the checkpoint: what is committed was saved
        guard.after_epoch(),  # stops at the end of an epoch whose last update found a stop signal
        *lines,
    ]


def _skipped_corrupt(data):
    """The training files skipped (--skip_corrupt), summed over ranks, into the epoch logs."""
    if data.skipped_corrupt is None:
        return []

    def count(epoch, logs):
        local = int(data.skipped_corrupt.numpy())
        logs["skipped_corrupt_images"] = float(collectives.allreduce_sum([local], "hvd_lars.skipped")[0])

    return [keras.callbacks.LambdaCallback(on_epoch_end=count)]


def fit(model, data, plan, config, callbacks, step):
    """`model.fit` from update `step` to the plan's last: an epoch resumed mid-way first, then the whole
    epochs. The training stream starts at the micro-batches already consumed, without reading them
    (`InputPipeline.train_from`). A callback that sets `model.stop_training` ends training there."""
    while step < plan.total_steps:
        train = data.train_from(step * plan.accumulation_steps)
        if config.label_smoothing:
            train = train.map(lambda x, y, n=data.num_classes: (x, tf.one_hot(y, n)))
        epoch, done_in_epoch = divmod(step, plan.steps_per_epoch)
        model.fit(
            train,
            initial_epoch=epoch,
            epochs=plan.epochs if done_in_epoch == 0 else epoch + 1,
            steps_per_epoch=(plan.steps_per_epoch - done_in_epoch) * plan.accumulation_steps,
            callbacks=callbacks,
            verbose=0,  # rank 0's lines are EpochProgress's
            shuffle=False,  # the tf.data pipeline shuffles each rank's shard itself
        )
        step = int(model.optimizer.iterations)
        if model.stop_training:
            break


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


class ElasticBatchError(ValueError):
    """The workers of an elastic job cannot share the plan's global batch evenly."""


def run_elastic(config, extra_callbacks=()):
    """Trains according to `config` (`elastic` True) while workers leave and join; returns the summary.

    No collective comes before the elastic loop's first sync, where a joining worker meets the others:
    rank 0 alone describes the input (`describe_input`), every sync broadcasts that description first, and
    each rank builds its job from it at its first sync, then takes rank 0's variables. Each attempt builds
    this rank's shard and traces the step for the world size of the moment.

    Raises:
        ValueError: not launched by an elastic launcher, no `--global_batch_size`, or any error of `run`.
        ElasticBatchError: a new worker count does not divide the global batch (every rank).
    """
    # Horovod's response cache lets each rank fuse cached tensors by its own fusion threshold, which an
    # elastic reset leaves different on re-initialised ranks (results/faults.md, "worker joining"): off.
    os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
    collectives.init()
    check_launched(config)
    run = Run.resolve(config, config.global_batch_size, collectives.size(), extra_callbacks)
    shapes = None
    if collectives.is_chief():
        try:  # the error, if any, every rank raises at the first sync rather than wait for rank 0
            problem = faults.run_dir_problem(run.run_dir, 0)
            if problem:
                raise ValueError(problem)
            request = input_request(config, config.global_batch_size, 0, 1, run.run_dir)
            shapes = describe_input(config.dataset, request, **input_options(config))
        except (ValueError, OSError) as e:
            shapes = e

    def build(shapes):
        # The plan for 1 worker: global batch, steps and schedule are those of any worker count.
        job = start(run, make_plan(config, 1, shapes), shapes, agree=False)
        faults.heartbeat()  # building the model is this rank's progress while the others wait
        return job

    state = _JobState(shapes, build)
    state.attempts = 0
    with run.signals, run.watchdog:
        return hvd_elastic.run(functools.partial(_elastic_attempt, run))(state)


def _elastic_attempt(run, state):
    """One attempt of an elastic job at the world size of the moment."""
    config, rank, world_size = run.config, collectives.rank(), collectives.size()
    resolve_batch(config, world_size)  # ElasticBatchError, naming the worker counts that fit
    plan = make_plan(config, world_size, state.shapes)
    request = input_request(config, plan.per_rank_batch_size, rank, world_size, run.run_dir)
    data = get_input(config.dataset, request, **input_options(config))
    # The largest count of any rank: the number goes on when rank 0 joined later or the old one is gone.
    state.attempts = collectives.max_over_ranks(state.attempts + 1, name="hvd_lars.elastic.attempt")
    if collectives.is_chief():
        log.info(
            f"elastic attempt {state.attempts}: {world_size} worker(s) from update "
            f"{int(state.job.model.optimizer.iterations)}, {plan.per_rank_batch_size} images per rank per "
            f"micro-batch (global batch {plan.global_batch_size})"
        )
    return attempt(
        state.job, plan, data, commit=hvd_elastic.CommitState(state, config.elastic_commit_every_steps)
    )


class _JobState(State):
    """The elastic state of the job, built at its first sync: `sync()` broadcasts rank 0's input
    description (or its error, raised on every rank), builds the job (`build(shapes)` -> `Job`) on a rank
    that has none, shares rank 0's lineage (`Job.agree`), then syncs the model and optimizer
    (`hvd_elastic.KerasState`, to which commits, restores and resets go)."""

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
        self.job.agree()
        self.keras.sync()

    def save(self):
        self.keras.save()

    def restore(self):
        if self.keras is not None:  # nothing committed before the first sync finished
            self.keras.restore()

    def reset(self):
        if self.keras is not None:
            self.keras.reset()


def check_launched(config, environ=None):
    """Refuses `--elastic` outside an elastic launcher (HOROVOD_ELASTIC not "1") or without
    `--global_batch_size` (the plan must not change with the worker count), with a ValueError."""
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
    """`TrainConfig.resolve_batch` for `world_size` workers, raising `ElasticBatchError` that names the
    worker counts dividing the global batch."""
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
