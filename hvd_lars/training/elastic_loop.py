"""Elastic training of the main program: the training loop of `hvd_lars.training.train`, retried by
Horovod's elastic loop after every membership change (`horovodrun --min-np/--max-np
--host-discovery-script`, launch/elastic.sh).

What stays fixed when the worker count changes: the global batch (images per update), the accumulation
steps, the steps per epoch and the learning-rate schedule, a function of the update count (part of the
committed state). What adapts: the per-rank batch, global batch / (world size x accumulation steps), and
each rank's shard of the data. A world size that does not divide the global batch stops every rank at the
change with `ElasticBatchError`, naming the figures.
"""

import logging
import os

from hvd_lars.data import describe_input, get_input
from hvd_lars.parallel import collectives
from hvd_lars.parallel import elastic as hvd_elastic
from hvd_lars.training import faults, recipe, threads, train
from hvd_lars.training.plan import batch_sizes, make_plan

try:  # Horovod's framework-neutral elastic state (what its elastic loop drives)
    from horovod.common.elastic import State as _State
except ImportError:  # pragma: no cover - Horovod is part of this project's environment
    _State = object


log = logging.getLogger(__name__)


class ElasticBatchError(ValueError):
    """The workers of an elastic job cannot share the plan's global batch evenly."""


def run(config, extra_callbacks=()):
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
    requested = threads.configure_threads(config, collectives.size())
    run_name, run_dir = train.run_directory(config, config.global_batch_size)
    shapes = None
    if collectives.is_chief():
        try:
            problem = faults.run_dir_problem(run_dir, 0)
            if problem:
                raise ValueError(problem)
            request = recipe.input_request(config, config.global_batch_size, 0, 1, run_dir)
            shapes = describe_input(config.dataset, request, **recipe.input_options(config))
        except (ValueError, OSError) as e:
            shapes = e  # every rank raises it at the first sync, rather than wait for a rank 0 gone
    signals, watchdog = faults.StopSignals(), faults.ProgressWatchdog(config.hang_timeout_s)

    def build(shapes):
        # The optimizer and the checkpoint's plan from the plan for 1 worker: the global batch, the steps
        # and the schedule are the same for every worker count that divides the global batch.
        plan = make_plan(config, 1, shapes)
        job = train.start(
            config,
            plan,
            run_name,
            run_dir,
            shapes,
            requested,
            signals,
            watchdog,
            extra_callbacks,
            agree=False,
        )
        faults.heartbeat()  # building the model is this rank's progress while the others wait
        return job

    state = _JobState(shapes, build)
    # The attempts this process has seen; at each attempt the largest count of any rank, so that the
    # number goes on when rank 0 is a worker that joined later, or when the old rank 0 is gone.
    attempts = [0]

    def attempt(state):
        rank, world_size = collectives.rank(), collectives.size()
        resolve_batch(config, world_size)  # ElasticBatchError, naming the worker counts that fit
        plan = make_plan(config, world_size, state.shapes)
        request = recipe.input_request(config, plan.per_rank_batch_size, rank, world_size, run_dir)
        data = get_input(config.dataset, request, **recipe.input_options(config))
        attempts[0] = collectives.max_over_ranks(attempts[0] + 1, name="hvd_lars.elastic.attempt")
        if collectives.is_chief():
            log.info(
                f"elastic attempt {attempts[0]}: {world_size} worker(s) from update "
                f"{int(state.job.model.optimizer.iterations)}, {plan.per_rank_batch_size} images per rank "
                f"per micro-batch (global batch {plan.global_batch_size})"
            )
        commit = hvd_elastic.CommitState(state, config.elastic_commit_every_steps)
        return train.attempt(state.job, plan, data, commit=commit)

    with signals, watchdog:
        return hvd_elastic.run(attempt)(state)


class _JobState(_State):
    """The elastic state of the main program's job, whose model is built at its first sync.

    `sync()` broadcasts rank 0's `InputShapes` first (the first collective of every start and restart,
    the same on a worker that joins as on those that wait for it), builds the job from them on a rank
    that has none yet (`build(shapes)` -> `train.Job`), gives every rank rank 0's lineage or its refusal
    of the run directory's checkpoint (`train.Job.agree`), then syncs the model and optimizer
    (`hvd_lars.parallel.elastic.KerasState`, with the update count as `step`). Commits, restores and
    resets go to that `KerasState`; host updates are checked by this object, the one the loop listens to.

    Args:
        shapes: rank 0's `InputShapes`, or the error describing the input raised there (every rank
            raises it at the sync); None on the other ranks.
        build: callable(`InputShapes`) -> `train.Job`.
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
    """(global batch, per-rank batch) for `world_size` workers: `plan.batch_sizes`, with an error that
    says it is the elastic job's new worker count that does not fit.

    Raises:
        ElasticBatchError: global batch % (world size x accumulation steps) != 0, naming the three
            figures and the worker counts that would divide it.
    """
    try:
        return batch_sizes(config, world_size)
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
