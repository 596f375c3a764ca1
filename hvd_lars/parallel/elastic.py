"""Elastic training (`horovodrun --min-np/--max-np --host-discovery-script`): the state of a Keras 3 model
committed, restored and synchronised on Horovod's framework-neutral `horovod.common.elastic`, and the
loop that retries after a membership change. Why not Horovod's own states: docs/design.md, "Elastic".
"""

import keras

from hvd_lars.arguments import at_least, check
from hvd_lars.parallel import collectives
from hvd_lars.parallel.accumulation import at_update_boundary

try:  # Horovod's framework-neutral elastic state; without Horovod, KerasState raises at construction.
    from horovod.common.elastic import ObjectState as _ObjectState
except ImportError:  # pragma: no cover - Horovod is part of this project's environment
    _ObjectState = object


class KerasState(_ObjectState):
    """The elastic state of a Keras 3 model and its optimizer (Horovod's `hvd.elastic.KerasState`): every
    variable of both, and picklable keyword attributes (`batch=0, epoch=0`, read as `state.epoch`), on a
    `horovod.common.elastic.ObjectState`: `commit()` (a host copy, then `HostsUpdatedInterrupt` on every
    rank if the membership changed; at update boundaries only), `restore()`, `sync()` (rank 0's values on
    every rank, then a commit) and `reset()`; sync and reset drop the traced step (it holds the world size).

    `model`: built, its optimizer built too (one `fit` step, or `optimizer.build(model.trainable_variables)`);
    `optimizer`: None for `model.optimizer`. ValueError: the model is not built; ImportError: no Horovod.
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


def run(func):
    """`func(state)` under Horovod's elastic loop (`horovod.common.elastic.run_fn`, as
    `horovod.tensorflow.elastic.run`): synchronised from rank 0, retried from the last commit after a
    membership change or a worker's death; returns what the attempt that completes returns."""
    import horovod.tensorflow as hvd
    from horovod.common.elastic import run_fn

    def reset():
        hvd.shutdown()
        hvd.init()

    return run_fn(retry_collective_failures(func), reset)


def retry_collective_failures(func):
    """`func` with every failed Horovod collective raised as `HorovodInternalError`, which Horovod's
    elastic loop answers with a restore and a retry (Horovod's retries only three op names): TensorFlow's
    `UnknownError` naming Horovod, Gloo, MPI or one of this package's ops (a dead peer's Gloo error names
    only the node, "Connection reset by peer [[{{node hvd_lars.gradient.17}}]]"); other errors pass."""
    import functools
    import re

    import tensorflow as tf
    from horovod.common.exceptions import HorovodInternalError

    @functools.wraps(func)
    def attempt(state, *args, **kwargs):
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as e:
            if re.search(r"horovod|gloo|\bmpi|hvd_lars\.", e.message or "", re.IGNORECASE):
                raise HorovodInternalError(e) from e
            raise

    return attempt


class CommitState(keras.callbacks.Callback):
    """Commits `state` (a `KerasState` with a `step` attribute, set to the count) every `every_steps`
    updates (a whole number >= 1), never inside a gradient-accumulation cycle; one due at an epoch's last
    update waits for the epoch's end, after the callbacks placed before this one (evaluation, logs,
    checkpoint)."""

    def __init__(self, state, every_steps):
        super().__init__()
        check("every_steps", every_steps, at_least(1, whole=True))
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
        self._commit_if_due()

    def _commit_if_due(self):
        step = int(self.model.optimizer.iterations)
        if step == self._last or step % self.every_steps or not at_update_boundary(self.model.optimizer):
            return
        self._last = step
        self.state.step = step
        self.state.commit()
