"""Elastic training: workers leave and join a running job (`horovodrun --min-np/--max-np
--host-discovery-script`), and training goes on from the last commit with the plan's global batch.

Built on Horovod's framework-neutral elastic machinery (`horovod.common.elastic`: the `State` that is
committed, restored and synchronised, and `run_fn`, which re-initialises Horovod and retries after a
membership change) with this project's own collectives. Horovod's `TensorFlowKerasState` does not work
with Keras 3 (it calls `optimizer.variables()`, which Keras 3 made a property), and its `TensorFlowState`
broadcasts its variables once, when it is built, and never again in TensorFlow 2, so a worker that joins
later would keep its own initial weights. The main program's elastic loop is `hvd_lars.training.elastic`.

Every attempt re-traces the training step (`model.train_function = None`): the traced graph holds
decisions taken from the world size at trace time (no allreduce at all with one rank).
"""

import keras

from hvd_lars.parallel import collectives


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
