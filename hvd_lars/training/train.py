"""The training loop (docs/design.md, "The loop"): `run`, of a fixed world size, and `run_elastic`."""

import dataclasses
import functools
import logging
import os

import keras
import tensorflow as tf

try:  # Horovod's elastic state (--elastic); without Horovod, training is one process
    from horovod.common.elastic import State
except ImportError:
    State = object

from hvd_lars.data import describe_input, get_input
from hvd_lars.models import get_model
from hvd_lars.optim.rate_callbacks import LearningRateLogger
from hvd_lars.parallel import collectives
from hvd_lars.parallel import elastic as hvd_elastic
from hvd_lars.parallel.callbacks import MetricAverageCallback, broadcast_model_and_optimizer
from hvd_lars.training import checkpoints, epoch_logs, faults, threads
from hvd_lars.training.checkpoints import PeriodicCheckpoint  # tests/support/kill_at_step.py replaces it
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
class Job:
    """A run; `started`: rank 0's (the checkpoint restored or None, the refusal or None)."""

    config: TrainConfig
    run_dir: str
    signals: faults.StopSignals
    watchdog: faults.ProgressWatchdog
    extra_callbacks: list
    model: keras.Model = None
    checkpoint: tf.train.Checkpoint = None
    manager: tf.train.CheckpointManager = None
    progress: Progress = None
    started: tuple = (None, None)

    @classmethod
    def resolve(cls, config, global_batch, extra_callbacks=()):
        name = config.run_name or f"{config.dataset}_{config.model}_{config.optimizer}_b{global_batch}"
        threads.configure_threads(config)  # the pool sizes the run log shows per rank
        signals, watchdog = faults.StopSignals(), faults.ProgressWatchdog(config.hang_timeout_s)
        return cls(config, os.path.join(config.workdir, name), signals, watchdog, list(extra_callbacks))

    def agree(self):
        """A collective: rank 0's start on every rank, or its refusal raised (`ResumeRefused`)."""
        restored, refusal = collectives.broadcast_object(self.started, name="hvd_lars.start")
        if refusal:
            raise checkpoints.ResumeRefused(refusal)
        self.progress.resume(restored)
        if self.manager is None:
            folder, keep = os.path.join(self.run_dir, "checkpoints"), self.config.keep_checkpoints
            self.manager = tf.train.CheckpointManager(self.checkpoint, folder, max_to_keep=keep)


def run(config, extra_callbacks=()):
    """Trains `config` on every rank; returns the summary dict. Raises ValueError (bad configuration or run
    directory), FileNotFoundError, and `faults.TrainingDiverged`, `Preempted`, `FileFailure`."""
    rank, world_size = collectives.init(launched_only=True)
    global_batch, per_rank_batch = config.resolve_batch(world_size)
    job = Job.resolve(config, global_batch, extra_callbacks)
    faults.check_run_dir(job.run_dir, 0, 0)  # writable, before anything of the run is read or made
    with faults.RunDirClaim(job.run_dir):  # no second job on this directory
        request = input_request(config, per_rank_batch, rank, world_size, job.run_dir)
        data = get_input(config.dataset, request, **input_options(config))
        plan = make_plan(config, world_size, data, batch=(global_batch, per_rank_batch))
        start(job, plan, data)
        broadcast_model_and_optimizer(job.model)
        with job.signals, job.watchdog:
            return attempt(job, plan, data)


def start(job, plan, shapes, agree=True):
    """The compiled model and optimizer of `plan` and rank 0's `checkpoints.resume`, shared if `agree`."""
    config, chief = job.config, collectives.is_chief()
    keras.utils.set_random_seed(config.seed + collectives.rank())
    keras.mixed_precision.set_global_policy(plan.precision)
    model = get_model(config.model, num_classes=shapes.num_classes, input_shape=shapes.input_shape)
    optimizer = build_optimizer(config, plan)
    loss, metrics = loss_and_metrics(config, shapes.num_classes)
    # Horovod's collectives must stay outside XLA clusters (its XLA ops are not built).
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics, jit_compile=False)
    build = functools.partial(optimizer.build, model.trainable_variables)  # a no-op once built
    job.model, job.progress = model, Progress(plan)
    if chief:
        try:
            path = checkpoints.resume(model, optimizer, build, job.run_dir, plan, config.allow_plan_change)
            job.started = (path, None)
        except checkpoints.ResumeRefused as e:
            job.started = (None, str(e))
    build()
    records = dict(plan=checkpoints.plan_variable(plan.settings), progress=job.progress.variable)
    job.checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, **records)
    if agree:
        job.agree()


def attempt(job, plan, data, commit=None):
    """Trains from the update count to the end of `plan` on this rank's `data`; returns the summary."""
    config, model, run_dir, chief = job.config, job.model, job.run_dir, collectives.is_chief()
    model.train_function = None  # traced for this attempt's world size
    applied = threads.applied_threads(data.train)
    mine = {**threads.placement(), "host": os.uname().nodename, **applied}
    placements = collectives.gather_objects(mine, name="hvd_lars.placement")  # every rank's, for the run log
    applied["cores_per_rank"] = [p["cores"] for p in placements]
    if chief:
        log.info(plan.describe())
        log.info(threads.describe_placements(placements))
        if note := batch_norm_note(model, plan):
            log.info(note)
        log.info(f"run directory {run_dir}")
    variables = model.variables + model.optimizer.variables
    faults.check_run_dir(run_dir, faults.checkpoint_bytes(variables), config.keep_checkpoints)
    start_step = int(model.optimizer.iterations)
    if plan.finished(start_step):
        if chief:
            done = f"{start_step} of {plan.total_steps} steps"
            log.info(f"{run_dir} complete ({done}); nothing to do: {checkpoints.AFRESH.format(run_dir)}.")
        return RunSummary.load(run_dir)
    summary = RunSummary(run_dir, config, plan, start_step, applied, job.progress)
    try:
        fit(model, data, plan, config, callbacks_in_order(job, data, plan, summary, commit), start_step)
    except (faults.TrainingDiverged, faults.Preempted) as e:
        summary.record_stop(type(e).__name__, e.step, str(e))
        raise
    summary.finish(job.manager.latest_checkpoint)
    return summary.summary


def callbacks_in_order(job, data, plan, summary, commit=None):
    """The callbacks of one attempt, in the order Keras runs them (docs/design.md, "The loop")."""
    config, chief, start_step = job.config, collectives.is_chief(), int(job.model.optimizer.iterations)
    images_per_batch = plan.per_rank_batch_size * collectives.size()
    exact = functools.partial(ExactEvaluation, every_epochs=config.eval_every_epochs, last_epoch=plan.epochs)
    saves = (config.checkpoint_every_steps, plan.accumulation_steps, config.checkpoint_at_epoch_end)
    checkpointer = PeriodicCheckpoint(job.manager, *saves, config.async_checkpoints, job.progress)
    guard = faults.FaultGuard(job.signals, checkpointer, plan.accumulation_steps, plan.total_steps)
    evaluations = [exact(data.eval, data.num_eval_examples)]
    if data.validation is not None:  # the held-out training images (--validation_examples), as val_*
        evaluations.append(exact(data.validation, data.num_validation_examples, prefix="val"))
    loggers, lines, path = [], [], functools.partial(os.path.join, job.run_dir)
    if chief:
        csv = epoch_logs.MetricsCSV(path("metrics.csv"), start_step)
        loggers = [csv, epoch_logs.TensorBoardScalars(path("tensorboard"))]
    if chief and config.verbose:
        every_s = config.progress_every_s if config.verbose == 1 else None
        batches = plan.steps_per_epoch * plan.accumulation_steps
        lines = [epoch_logs.EpochProgress(plan.epochs, batches, images_per_batch, every_s)]
    return [
        guard,  # first: nothing of a diverged update is evaluated, logged, saved or committed
        job.watchdog,
        job.progress,  # an epoch resumed mid-way starts from its earlier updates' metric sums; images/s
        MetricAverageCallback(),  # every callback below sees rank-averaged training metrics
        *_skipped_corrupt(data),
        LearningRateLogger(),
        *evaluations,
        *job.extra_callbacks,
        *loggers,
        summary,
        checkpointer,  # after the loggers: no epoch's checkpoint exists without that epoch's logs
        *([commit] if commit is not None else []),  # after the checkpoint: what is committed was saved
        guard.after_epoch(),  # stops at the end of an epoch whose last update found a stop signal
        *lines,
    ]


def _skipped_corrupt(data):  # --skip_corrupt's count of files skipped, summed over ranks, in the logs
    def count(epoch, logs):
        local = int(data.skipped_corrupt.numpy())
        logs["skipped_corrupt_images"] = float(collectives.allreduce_sum([local], "hvd_lars.skipped")[0])

    return [] if data.skipped_corrupt is None else [keras.callbacks.LambdaCallback(on_epoch_end=count)]


def fit(model, data, plan, config, callbacks, step):
    """`model.fit` from update `step` to the plan's last: a part of an epoch first, then whole epochs."""
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


def run_elastic(config, extra_callbacks=()):
    """`run` while workers leave and join; raises as `run` does, and `check_launched`'s ValueError."""
    # Horovod's response cache off: re-initialised ranks would fuse differently (docs/faults.md).
    os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
    check_launched(config)
    collectives.init()
    job = Job.resolve(config, config.global_batch_size, extra_callbacks)
    shapes = None
    if collectives.is_chief():
        try:  # the error, if any, every rank raises at the first sync rather than wait for rank 0
            if problem := faults.run_dir_problem(job.run_dir, 0):
                raise ValueError(problem)
            request = input_request(config, config.global_batch_size, 0, 1, job.run_dir)
            shapes = describe_input(config.dataset, request, **input_options(config))
        except (ValueError, OSError) as e:
            shapes = e
    with job.signals, job.watchdog:
        return hvd_elastic.run(_elastic_attempt)(_JobState(job, shapes))


def _elastic_attempt(state):
    job, rank, world_size = state.job, collectives.rank(), collectives.size()
    batch = resolve_batch(job.config, world_size)  # a ValueError naming the worker counts that fit
    plan = make_plan(job.config, world_size, state.shapes, batch=batch)
    request = input_request(job.config, plan.per_rank_batch_size, rank, world_size, job.run_dir)
    data = get_input(job.config.dataset, request, **input_options(job.config))
    state.attempts = collectives.max_over_ranks(state.attempts + 1, name="hvd_lars.elastic.attempt")
    if collectives.is_chief():
        log.info(
            f"elastic attempt {state.attempts}: {world_size} worker(s) from update "
            f"{int(job.model.optimizer.iterations)}, {plan.per_rank_batch_size} images per rank per "
            f"micro-batch (global batch {plan.global_batch_size})"
        )
    return attempt(job, plan, data, hvd_elastic.CommitState(state, job.config.elastic_commit_every_steps))


class _JobState(State):
    """The elastic state of a `Job`: `sync()` starts a rank without a model, then syncs it with rank 0's."""

    def __init__(self, job, shapes):
        bcast = functools.partial(collectives.broadcast_object, name="hvd_lars.elastic.hosts")
        super().__init__(bcast_object=bcast, get_rank=collectives.rank)
        self.job, self.shapes, self.keras, self.attempts = job, shapes, None, 0

    def sync(self):
        self.shapes = collectives.broadcast_object(self.shapes, name="hvd_lars.elastic.shapes")
        if isinstance(self.shapes, Exception):
            raise self.shapes
        if self.shapes is None:
            raise RuntimeError("elastic sync: rank 0 holds no description of the input (it joined late?).")
        if self.keras is None:
            start(self.job, make_plan(self.job.config, 1, self.shapes), self.shapes, agree=False)
            faults.heartbeat()  # building the model is this rank's progress while the others wait
            self.keras = hvd_elastic.KerasState(self.job.model)
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
    """A ValueError for `--elastic` outside an elastic launcher or without `--global_batch_size`; an
    ImportError without Horovod."""
    if State is object:
        raise ImportError("--elastic needs Horovod (horovod.common.elastic): run `make setup` to build it.")
    elastic = (os.environ if environ is None else environ).get("HOROVOD_ELASTIC")
    if elastic != "1":
        raise ValueError(
            "--elastic needs an elastic launcher: horovodrun -np N --min-np MIN --max-np MAX "
            f"--host-discovery-script SCRIPT (launch/elastic.sh); HOROVOD_ELASTIC is {elastic!r}, not '1'."
        )
    if not config.global_batch_size:
        per_rank = config.per_rank_batch_size
        raise ValueError(f"--elastic needs --global_batch_size (got 0 with --per_rank_batch_size={per_rank})")


def resolve_batch(config, world_size):
    """`TrainConfig.resolve_batch` for `world_size` workers; its ValueError names the counts that fit."""
    try:
        return config.resolve_batch(world_size)
    except ValueError as e:
        batch, divisor = config.global_batch_size, config.accumulation_steps
        fits = ", ".join(str(n) for n in range(1, 65) if batch % (n * divisor) == 0)
        raise ValueError(
            f"the elastic job now has {world_size} workers: the global batch of {batch} images does not fit "
            f"them (x {divisor} accumulation steps); worker counts that divide it: {fits}. ({e})"
        ) from e
