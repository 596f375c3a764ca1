"""Elastic training of the main program: the training loop of `hvd_lars.training.train`, retried by
Horovod's elastic loop after every membership change (`horovodrun --min-np/--max-np
--host-discovery-script`, launch/elastic.sh).

What stays fixed when the worker count changes: the global batch (images per update), the accumulation
steps, the steps per epoch and the learning-rate schedule, a function of the update count (part of the
committed state). What adapts: the per-rank batch, global batch / (world size x accumulation steps), and
each rank's shard of the data. A world size that does not divide the global batch stops every rank at the
change with `ElasticBatchError`, naming the figures.
"""

import os

from hvd_lars.data import get_input
from hvd_lars.parallel import collectives
from hvd_lars.parallel import elastic as hvd_elastic
from hvd_lars.training import recipe, threads, train
from hvd_lars.training.plan import make_plan


class ElasticBatchError(ValueError):
    """The workers of an elastic job cannot share the plan's global batch evenly."""


def run(config, extra_callbacks=()):
    """Trains according to `config` (with `elastic` True) while workers leave and join; returns the summary.

    No collective comes before the elastic loop's first sync: a worker that joins later runs this code
    while the others wait in that sync. The model is built from the data's shapes alone; each attempt
    builds this rank's shard for the world size of the moment and re-traces the training step, whose
    graph holds the last world size's decisions (no allreduce at all with one rank).

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
    config.validate(1)
    requested = threads.configure_threads(config, collectives.size())
    run_name, run_dir = train.run_directory(config, 1)
    shapes = get_input(config.dataset, **recipe.input_kwargs(config, config.global_batch_size, 0, 1, run_dir))
    job = train.start(config, run_name, run_dir, shapes, 1, requested, extra_callbacks, agree=False)
    state = hvd_elastic.KerasState(job.model, step=int(job.model.optimizer.iterations)).state()

    def attempt(state):
        rank, world_size = collectives.rank(), collectives.size()
        _, per_rank_batch = resolve_batch(config, world_size)
        data = get_input(
            config.dataset, **recipe.input_kwargs(config, per_rank_batch, rank, world_size, run_dir)
        )
        job.model.train_function = None  # traced anew for this world size
        if collectives.is_chief():
            plan = make_plan(config, world_size, data.num_train_examples)
            print(
                f"[hvd_lars] elastic attempt {job.attempts + 1}: {world_size} worker(s) from update "
                f"{int(job.model.optimizer.iterations)}, {plan.per_rank_batch_size} images per rank per "
                f"micro-batch (global batch {plan.global_batch_size})",
                flush=True,
            )
        commit = hvd_elastic.CommitState(state, config.elastic_commit_every_steps)
        return train.attempt(job, data, commit=commit)

    with job.signals, job.watchdog:
        return hvd_elastic.run(attempt)(state)


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
    """(global batch, per-rank batch) for `world_size` workers: `config.resolve_batch`, with an error
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
