"""The main program with injected fault for the resume tests: the process SIGKILLs itself once
`--kill_at_step` optimizer updates are applied, as a pre-empted or crashed job dies (no clean-up, no
final checkpoint). Test-only: it adds one Keras callback through `hvd_lars.train.run(extra_callbacks=...)`,
after the checkpoint callback, so a checkpoint due at that update is written before the kill: with
asynchronous checkpoints (the default) the kill waits for rank 0's background write to complete, so the
tests see a job killed just after a save, whatever the disk's speed. (Killed while a write is under way,
a job keeps the checkpoint before it: tests/test_resume.py.)

Usage: python tests/kill_at_step.py --kill_at_step=N [every flag of python -m hvd_lars.main]
(also one process per rank under horovodrun: every rank dies after the same update).
"""

import functools
import os
import signal

import keras
from absl import flags

from hvd_lars import callbacks, main, train

flags.DEFINE_integer("kill_at_step", 0, "SIGKILL this process once this many updates are applied (0: never).")


class KillAtStep(keras.callbacks.Callback):
    """SIGKILLs this process at the end of the batch whose update brings the optimizer to `step` updates
    (with gradient accumulation: the micro-batch that applies it)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations) >= self.step:
            for checkpointer in _checkpointers:
                checkpointer.sync()
            os.kill(os.getpid(), signal.SIGKILL)


_checkpointers = []


class _RecordedPeriodicCheckpoint(callbacks.PeriodicCheckpoint):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _checkpointers.append(self)


def _run_with_fault(config, run=train.run):
    step = flags.FLAGS.kill_at_step
    return run(config, extra_callbacks=[KillAtStep(step)] if step else ())


if __name__ == "__main__":
    # hvd_lars.main imports `run` from hvd_lars.train when it starts, so it picks up the faulty one.
    train.run = functools.partial(_run_with_fault, run=train.run)
    callbacks.PeriodicCheckpoint = _RecordedPeriodicCheckpoint
    main.main()
