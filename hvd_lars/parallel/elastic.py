"""Elastic training: workers leave and join a running job (`horovodrun --min-np/--max-np
--host-discovery-script`), and training goes on from the last commit with the plan's global batch.

Built on Horovod's framework-neutral elastic machinery (`horovod.common.elastic`: the `State` that is
committed, restored and synchronised, and `run_fn`, which re-initialises Horovod and retries after a
membership change) with this project's own collectives. Horovod's `TensorFlowKerasState` does not work
with Keras 3 (it calls `optimizer.variables()`, which Keras 3 made a property), and its `TensorFlowState`
broadcasts its variables once, when it is built, and never again in TensorFlow 2, so a worker that joins
later would keep its own initial weights. The main program's elastic loop is `hvd_lars.training.train`.

Every attempt re-traces the training step (`model.train_function = None`): the traced graph holds
decisions taken from the world size at trace time (no allreduce at all with one rank).
"""

import keras

from hvd_lars.parallel import collectives
from hvd_lars.parallel.accumulation import at_update_boundary

try:  # Horovod's framework-neutral elastic state; without Horovod, KerasState raises at construction.
    from horovod.common.elastic import ObjectState as _ObjectState
except ImportError:  # pragma: no cover - Horovod is part of this project's environment
    _ObjectState = object


class KerasState(_ObjectState):
    """The elastic state of a Keras 3 model and its optimizer (Horovod's `hvd.elastic.KerasState`): every
    variable of both (weights, batch-norm statistics, slots, the update counter `iterations`, gradient
    accumulators), plus picklable attributes given as keyword arguments (`batch=0, epoch=0`), kept on
    rank 0's values at a sync and exposed as attributes (`state.epoch`).

    A `horovod.common.elastic.State`, so Horovod's elastic loop (`run`) drives it, and
    `state.register_reset_callbacks([fn, ...])` runs `fn()` after each membership change, before the
    next sync. Methods, as the loop calls them:
        commit(): saves a copy of the variables in host memory (NumPy, about the model's size plus its
            slots), then raises `HostsUpdatedInterrupt` on every rank alike if the driver announced a
            membership change (a collective). Commit at update boundaries only (`CommitStateCallback`
            and `CommitState` do): a copy taken in the middle of a gradient-accumulation cycle would
            be restored with half a cycle's gradients, and the loop then redoes that cycle's batches.
        restore(): puts the last committed values back (after a worker died mid-update).
        sync(): rank 0's variables and attributes on every rank (`collectives.broadcast_variables`,
            which first checks that the ranks' variable lists agree), then a commit of them.
        reset(): after a membership change, before the reset callbacks and the next sync. Both drop the
            model's traced training step (`model.train_function = None`), which holds the world size it
            was traced with.

    Args:
        model: a built Keras 3 model (its optimizer built, e.g. by one `fit` step, as Horovod's example
            does, or by `optimizer.build(model.trainable_variables)`).
        optimizer: None: `model.optimizer`.
        **attributes: picklable values (ints, floats, ...) committed with the variables.

    Raises:
        ValueError: the model is not built. ImportError: Horovod is not installed.
    """

    def __init__(self, model, optimizer=None, **attributes):
        if _ObjectState is object:
            raise ImportError("KerasState needs Horovod (horovod.common.elastic); run `make setup`.")
        from hvd_lars.parallel.callbacks import is_built

        if not is_built(model):
            raise ValueError(
                f"KerasState: model {model.name!r} is not built; build it first (keras.Input, "
                "model.build(input_shape), or one fit step as Horovod's example does)."
            )
        self.model = model
        self.optimizer = optimizer or model.optimizer
        self._save_variables()
        super().__init__(
            bcast_object=lambda value: collectives.broadcast_object(value, name="hvd_lars.parallel.elastic"),
            get_rank=collectives.rank,
            **attributes,
        )

    def _state_variables(self):
        # Dropout seed states stay per rank, as `broadcast_model_and_optimizer` leaves them.
        every = list(self.model.variables) + list(self.optimizer.variables)
        return [v for v in every if "seed_generator" not in v.path]

    def _save_variables(self):
        self._saved = [v.numpy() for v in self._state_variables()]

    def save(self):
        self._save_variables()
        super().save()

    def restore(self):
        for var, value in zip(self._state_variables(), self._saved):
            var.assign(value)
        super().restore()

    def reset(self):
        # Before the reset callbacks, which may run a step (Horovod's example does) with the new ranks.
        self.model.train_function = None

    def sync(self):
        self.model.train_function = None  # traced anew for the current world size
        collectives.broadcast_variables(self._state_variables(), what="elastic state")
        self._save_variables()
        super().sync()

    def state(self):
        """This object (the `horovod.common.elastic.State` to hand to `run`); kept for callers that
        wrote `KerasState(model, ...).state()`."""
        return self


def run(func):
    """`func(state)` under Horovod's elastic loop (`horovod.common.elastic.run_fn`, as
    `horovod.tensorflow.elastic.run`): synchronised from rank 0 first, then retried on every rank after a
    membership change (Horovod shut down and re-initialised with the new world size) or a worker's death
    (the committed state restored first). `func` must start no collective before its own code runs on
    every rank, i.e. every collective of an attempt belongs inside it.

    Unlike Horovod 0.28.1's TensorFlow wrapper, which turns a failed collective into a retry only when the
    error names `HorovodAllreduce`, `HorovodAllgather` or `HorovodBroadcast` and otherwise returns None
    (so a failure in a grouped allreduce, the op every gradient reduction here uses, ended the job with no
    result and no error on the surviving ranks), every collective failure is retried
    (`collective_failure`) and any other error is raised as it is.

    Returns:
        what `func` returns on the attempt that completes.
    """
    import horovod.tensorflow as hvd
    from horovod.common.elastic import run_fn

    def reset():
        hvd.shutdown()
        hvd.init()

    return run_fn(retry_collective_failures(func), reset)


def collective_failure(error):
    """True when `error` (an exception) is a Horovod collective that failed, e.g. because a rank went
    away: TensorFlow's `UnknownError` whose message names Horovod (any of its ops, `HorovodAllreduce`,
    `HorovodGroupedAllreduce`, ..., or its shut-down background loop), its transports (Gloo, MPI), or one
    of this project's collectives (every op `collectives` starts is named `hvd_lars.*`): a dead peer's
    Gloo error reads "[.../gloo/transport/tcp/pair.cc:589] Read error [198.18.0.13]:41612: Connection
    reset by peer [[{{node hvd_lars.gradient.17}}]]", naming no Horovod op."""
    import re

    import tensorflow as tf

    if not isinstance(error, tf.errors.UnknownError):
        return False
    return re.search(r"horovod|gloo|\bmpi|hvd_lars\.", error.message or "", re.IGNORECASE) is not None


def retry_collective_failures(func):
    """`func` with every collective failure raised as `HorovodInternalError`, which Horovod's elastic
    loop answers by restoring the last commit and retrying; other errors pass unchanged."""
    import functools

    from horovod.common.exceptions import HorovodInternalError

    @functools.wraps(func)
    def attempt(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised unless it is a collective's failure
            if collective_failure(e):
                raise HorovodInternalError(e) from e
            raise

    return attempt


class CommitState(keras.callbacks.Callback):
    """Commits the elastic state every `every_steps` updates (at update boundaries, counting
    `optimizer.iterations`), recording the update count in `state.step`: a membership change is taken
    up at the next commit, and a worker's death costs the updates since the last one.

    Never in the middle of a gradient-accumulation cycle: a commit is due when `optimizer.iterations`
    (applied updates) has reached a multiple of `every_steps` that was not committed yet and no
    micro-batch is pending (`at_update_boundary`), so the state restored after a failure holds no half
    cycle and the loop's redone batches complete whole updates.

    A commit due at an epoch's last update waits for that epoch's end, so that the epoch's evaluation,
    logs and checkpoint happen before a membership change is taken up. Place it after the fault guard,
    the loggers and the checkpoint callbacks, so that a diverged update is never committed. Each commit
    copies every variable to host memory and does one small broadcast.

    Args:
        state: a `KerasState` with a `step` attribute.
        every_steps: int >= 1.
    """

    def __init__(self, state, every_steps):
        super().__init__()
        if int(every_steps) != every_steps or every_steps < 1:
            raise ValueError(f"elastic commit interval must be an int >= 1, got {every_steps!r}.")
        self.state = state
        self.every_steps = int(every_steps)
        self._last = None

    def on_train_begin(self, logs=None):
        self._last = int(self.model.optimizer.iterations)  # what the attempt started from is committed

    def on_train_batch_end(self, batch, logs=None):
        if self.params and batch + 1 == self.params.get("steps"):
            return  # the epoch's last update: committed at the epoch's end (below)
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        # After the callbacks placed before this one (evaluation, logs, the epoch's checkpoint): a
        # membership change taken up here never skips the end of the epoch it interrupts.
        self._commit_if_due()

    def _commit_if_due(self):
        step = int(self.model.optimizer.iterations)
        if step == self._last or step % self.every_steps or not at_update_boundary(self.model.optimizer):
            return
        self._last = step
        self.state.step = step
        self.state.commit()


class CommitStateCallback(keras.callbacks.Callback):
    """Horovod's `hvd.elastic.CommitStateCallback`: commits `state` every `batches_per_commit` batches and
    at the end of every epoch, at update boundaries only: a commit due while a gradient-accumulation
    cycle is incomplete waits for the batch that completes it (see `CommitState`).

    Args:
        state: a `KerasState`.
        batches_per_commit: int >= 1 (1, Horovod's default).
    """

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        if (
            isinstance(batches_per_commit, bool)
            or not isinstance(batches_per_commit, int)
            or batches_per_commit < 1
        ):
            raise ValueError(f"batches_per_commit must be an int >= 1, got {batches_per_commit!r}.")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self._batches = 0
        self._due = False

    def on_train_begin(self, logs=None):
        self._batches, self._due = 0, False  # the same count on every rank after a sync

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.batches_per_commit == 0:
            self._due = True
        self._commit_if_due()

    def on_epoch_end(self, epoch, logs=None):
        self._due = True
        self._commit_if_due()

    def _commit_if_due(self):
        if self._due and at_update_boundary(self.model.optimizer):
            self._due = False
            self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Horovod's `hvd.elastic.UpdateBatchStateCallback`: keeps `state.batch` = the batches of the current
    epoch done so far (0 at each epoch end), and after a reset shortens the first epoch of the next
    `fit` by the batches the restored state had done, so each epoch still has `steps_per_epoch` batches.

    (Horovod's stores the last batch's index, one less, and shortens through `params['steps']`, which
    Keras 3's loop no longer reads; here the shortened epoch ends through `model.stop_training`, set
    after its last batch and cleared again at its end, so callbacks see a normal epoch end and `fit`
    goes on. A callback placed before this one that stops training at that epoch's end is overridden.)

    Args:
        state: a `KerasState` with a `batch` attribute.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._done_before = 0
        self._stopped = False

    def on_train_begin(self, logs=None):
        self._done_before = int(self.state.batch)

    def on_epoch_begin(self, epoch, logs=None):
        self._stopped = False

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._done_before + batch + 1
        steps = (self.params or {}).get("steps")
        if self._done_before and steps and self.state.batch >= steps and not self.model.stop_training:
            self.model.stop_training = self._stopped = True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._done_before = 0
        if self._stopped:
            self.model.stop_training = self._stopped = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Horovod's `hvd.elastic.UpdateEpochStateCallback`: at each epoch end, `state.epoch` = the epochs
    done in all attempts (Keras counts from 0 in every `fit`; the attempt's start is `state.epoch` at
    `on_train_begin`).

    Args:
        state: a `KerasState` with an `epoch` attribute.
    """

    def __init__(self, state):
        super().__init__()
        self.state = state
        self._first_epoch = None

    def on_train_begin(self, logs=None):
        self._first_epoch = int(self.state.epoch)

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self._first_epoch + epoch + 1
