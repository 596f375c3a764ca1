"""Elastic training: workers leave and join a running job (`horovodrun --min-np/--max-np
--host-discovery-script`), and training goes on from the last commit with the plan's global batch.

Built on Horovod's framework-neutral elastic machinery (`horovod.common.elastic`: the `State` that is
committed, restored and synchronised, and `run_fn`, which re-initialises Horovod and retries after a
membership change) with this project's own collectives. Horovod's `TensorFlowKerasState` does not work
with Keras 3 (it calls `optimizer.variables()`, which Keras 3 made a property), and its `TensorFlowState`
broadcasts its variables once, when it is built, and never again in TensorFlow 2, so a worker that joins
later would keep its own initial weights.

What stays fixed when the worker count changes: the global batch (images per update), the accumulation
steps, the steps per epoch and the learning-rate schedule, which is a function of the update count
(`optimizer.iterations`, part of the committed state). What adapts: the per-rank batch, global batch /
(world size x accumulation steps), and each rank's shard of the data. A world size that does not divide
the global batch stops every rank at the change with `ElasticBatchError`, naming the figures.

Every attempt re-traces the training step (`model.train_function = None`): the traced graph holds
decisions taken from the world size at trace time (no allreduce at all with one rank).
"""

import os

import keras

from hvd_lars.parallel import collectives


class ElasticBatchError(ValueError):
    """The workers of an elastic job cannot share the plan's global batch evenly."""


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


class KerasState:
    """The elastic state of a Keras 3 model and its optimizer: every variable of both (weights,
    batch-norm statistics, slots, the update counter `iterations`), plus picklable attributes given as
    keyword arguments (kept on rank 0's values at a sync).

    Methods, as Horovod's elastic loop calls them (`horovod.common.elastic.State`):
        commit(): saves a copy of the variables in host memory (NumPy, about the model's size plus its
            slots), then raises `HostsUpdatedInterrupt` on every rank alike if the driver announced a
            membership change (a collective).
        restore(): puts the last committed values back (after a worker died mid-update).
        sync(): rank 0's variables and attributes on every rank (`collectives.broadcast_variables`,
            which first checks that the ranks' variable lists agree), then a commit of them.

    Built lazily so that `import hvd_lars` works without Horovod; `state()` returns the Horovod object.
    """

    def __init__(self, model, **attributes):
        from horovod.common.elastic import ObjectState

        def variables():
            # Dropout seed states stay per rank, as `broadcast_model_and_optimizer` leaves them.
            every = list(model.variables) + list(model.optimizer.variables)
            return [v for v in every if "seed_generator" not in v.path]

        class _State(ObjectState):
            def __init__(self):
                self._save_variables()
                super().__init__(
                    bcast_object=lambda value: collectives.broadcast_object(
                        value, name="hvd_lars.parallel.elastic"
                    ),
                    get_rank=collectives.rank,
                    **attributes,
                )

            def _save_variables(self):
                self._saved = [v.numpy() for v in variables()]

            def save(self):
                self._save_variables()
                super().save()

            def restore(self):
                for var, value in zip(variables(), self._saved):
                    var.assign(value)
                super().restore()

            def sync(self):
                collectives.broadcast_variables(variables(), what="elastic state")
                self._save_variables()
                super().sync()

        self._state = _State()

    def state(self):
        """The `horovod.common.elastic.ObjectState` to hand to `run`."""
        return self._state


def run(func):
    """`func(state)` under Horovod's elastic loop (`horovod.tensorflow.elastic.run`): synchronised from
    rank 0 first, then retried on every rank after a membership change (Horovod shut down and
    re-initialised with the new world size) or a worker's death (the committed state restored first).
    `func` must start no collective before its own code runs on every rank, i.e. every collective of an
    attempt belongs inside it."""
    import horovod.tensorflow as hvd

    return hvd.elastic.run(func)


class CommitState(keras.callbacks.Callback):
    """Commits the elastic state every `every_steps` updates (at update boundaries, counting
    `optimizer.iterations`), recording the update count in `state.step`: a membership change is taken
    up at the next commit, and a worker's death costs the updates since the last one.

    Place it after the fault guard and the checkpoint callbacks, so that a diverged update is never
    committed. Each commit copies every variable to host memory and does one small broadcast.

    Args:
        state: the `horovod.common.elastic.ObjectState` of `KerasState.state()`, with a `step` attribute.
        every_steps: int >= 1.
    """

    def __init__(self, state, every_steps):
        super().__init__()
        if int(every_steps) != every_steps or every_steps < 1:
            raise ValueError(f"elastic commit interval must be an int >= 1, got {every_steps!r}.")
        self.state = state
        self.every_steps = int(every_steps)
        self._last = None

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations)
        if step == self._last or step % self.every_steps:
            return
        self._last = step
        self.state.step = step
        self.state.commit()
