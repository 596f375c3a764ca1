"""The run's per-epoch logs, `metrics.csv` and TensorBoard scalars, aligned in any evaluation schedule
and across kills and resumes.

Both write what the epoch logs hold at the end of each epoch (after `ExactEvaluation`, the rate logger
and the images/s callback have added theirs) with the epoch (0-based, as Keras counts) and the step
(optimizer updates applied so far). A run resumed at step s first drops what its killed predecessor
wrote for steps after s (the epochs it will train again), so no epoch appears twice.

Why not Keras's own `CSVLogger` and `TensorBoard` (Keras 3.15):
- `CSVLogger` fixes its columns at the first epoch end. With evaluation every 2 epochs the first epoch
  has no `test_*` keys, so those columns never appear, and because no key starts with `val_` it adds a
  `val_` copy of every column, all `NA`. With `append=True` a resumed run keeps the old header but
  writes rows of its own columns under it (19 fields under 13 names: the `top1` column held the test
  loss), and rows of epochs trained twice stay in the file.
- `TensorBoard` writes `val_*` under the training tags in a second folder (`val_top1` as `epoch_top1`
  in `validation/`), replaces the logged `learning_rate` by the optimizer's rate read after the epoch
  (for a schedule: the next update's rate), and after a resume writes the repeated epochs again into a
  new events file, so TensorBoard shows two values at one step.
"""

import csv
import glob
import os

import keras


def _step(model):
    return int(model.optimizer.iterations.numpy())


def _kept(epoch, step, start_step, steps_per_epoch):
    # Rows without a step (files written before it was logged) count by their epoch's last step.
    last = step if step is not None else (epoch + 1) * steps_per_epoch
    return last <= start_step


class MetricsCSV(keras.callbacks.Callback):
    """`metrics.csv`: one row per epoch, every row with the header's columns.

    Columns: `epoch` (0-based), `step` (updates applied at the epoch's end), then every key any epoch
    has reported so far, sorted. When a new key appears (the first evaluated epoch adds `test_*`) the
    file is rewritten with the wider header and the earlier rows get an empty field there; an empty
    field means "not measured that epoch". The file is rewritten whole at each epoch end, to a
    temporary file renamed over it, so a killed job leaves the rows of its finished epochs and never a
    torn row. Non-finite values are written as Python prints them (`nan`, `inf`).

    Args:
        path: the CSV file.
        start_step: updates already applied (a resumed run's step); the rows of later epochs, written by
            a killed predecessor that got further than its last checkpoint, are dropped.
        steps_per_epoch: updates per epoch (for rows without a step).

    Raises:
        ValueError: an existing file that is not such a CSV (no `epoch` column).
    """

    FIXED = ("epoch", "step")

    def __init__(self, path, start_step=0, steps_per_epoch=1):
        super().__init__()
        self.path = path
        self.rows = []
        if os.path.exists(path):
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames and "epoch" not in reader.fieldnames:
                    raise ValueError(f"{path} has no 'epoch' column: {reader.fieldnames}.")
                for row in reader:
                    epoch = int(row["epoch"])
                    step = int(row["step"]) if row.get("step") else None
                    if _kept(epoch, step, start_step, steps_per_epoch):
                        # "NA": what Keras's CSVLogger wrote for a key an epoch lacked.
                        self.rows.append({k: v for k, v in row.items() if v not in ("", "NA", None)})

    def on_epoch_end(self, epoch, logs=None):
        row = {"epoch": epoch, "step": _step(self.model), **(logs or {})}
        self.rows = [r for r in self.rows if int(r["epoch"]) != epoch] + [row]
        self._write()

    def _write(self):
        keys = sorted({k for r in self.rows for k in r} - set(self.FIXED))
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*self.FIXED, *keys], restval="")
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: _text(v) for k, v in row.items()})
        os.replace(tmp, self.path)


def _text(value):
    if isinstance(value, str):
        return value
    number = float(keras.ops.convert_to_numpy(value))
    return str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)


class TensorBoardScalars(keras.callbacks.Callback):
    """TensorBoard scalars in `log_dir`: each epoch-log key under one tag (its own name: `loss`, `top1`,
    `test_top1`, `val_top1`, `learning_rate`, `images_per_second`, ...; plus `epoch`, counted from 1), at
    the step (updates applied) of the epoch's end, written with `tf.summary`.

    A resumed run first removes from the event files in `log_dir` every scalar written at a step after
    `start_step` (rewriting those files without them, to a temporary file renamed over each), so the
    epochs it trains again appear once. An events file cut short by a kill keeps its complete records.

    Args:
        log_dir: folder of the event files.
        start_step: updates already applied (0 for a fresh run: any scalars there are dropped).
    """

    def __init__(self, log_dir, start_step=0):
        super().__init__()
        self.log_dir = log_dir
        self._writer = None
        prune_events(log_dir, start_step)

    def on_epoch_end(self, epoch, logs=None):
        import tensorflow as tf

        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        step = _step(self.model)
        with self._writer.as_default():
            tf.summary.scalar("epoch", epoch + 1, step=step)
            for key, value in sorted((logs or {}).items()):
                tf.summary.scalar(key, float(keras.ops.convert_to_numpy(value)), step=step)
        self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()


def prune_events(log_dir, last_step):
    """Removes the summaries written at steps after `last_step` from the event files in `log_dir` (not
    its sub-folders); returns how many were removed. Files without such summaries are left untouched."""
    import tensorflow as tf

    removed = 0
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        kept, dropped = [], 0
        try:
            for record in tf.data.TFRecordDataset(path):
                event = tf.compat.v1.Event.FromString(record.numpy())
                if event.HasField("summary") and event.step > last_step:
                    dropped += 1
                else:
                    kept.append(record.numpy())
        except tf.errors.DataLossError:
            dropped += 1  # a record cut short by a kill: the complete ones before it are kept
        if not dropped:
            continue
        tmp = os.path.join(log_dir, f"pruning.{os.path.basename(path)}")
        with tf.io.TFRecordWriter(tmp) as writer:
            for record in kept:
                writer.write(record)
        os.replace(tmp, path)
        removed += dropped
    return removed
