"""A failed write of the run's files or read of its data: every rank stops together, with one line.

A write (a checkpoint, metrics.csv, TensorBoard, summary.json) or a read of a training or evaluation file
that fails with an `OSError`, a TensorFlow I/O error or a decode error is noted where it happens (`note`)
instead of raised: raised on one rank alone, it would leave the others waiting in a collective. At the next
point where the ranks agree (the fault guard's vote after every update and at every epoch end, the
evaluation's count, every checkpoint) they find it (`vote`, `agree`) and every rank raises `FileFailure`
with the message of the lowest rank that noted one (`raise_noted`); the main program prints it as one line,
`hvd_lars: error: ...`, and exits with status 2. The last complete checkpoint is kept, and no checkpoint is
written once a failure is noted, so the same command resumes once the cause is gone.
"""

import os
import re

from hvd_lars.data.imagenet_preparation import COMMAND
from hvd_lars.parallel import collectives

_RESUME = "then start the same command again: it resumes from the last complete checkpoint."
_noted = None


class FileFailure(OSError):
    """A write of the run or a read of its data failed on some rank; the message names the file, why, and
    what to do."""


def note(message):
    """Keeps `message` (str) as this rank's failure, unless one is kept already (the first one is the
    cause; later ones follow from it)."""
    global _noted
    if _noted is None:
        _noted = message


def noted():
    """This rank's failure message, or None."""
    return _noted


def write_failure(path, error):
    """The message of a failed write of `path` (an `OSError` or `tf.errors.OpError` `error`)."""
    if getattr(error, "strerror", None):
        reason = f"[Errno {error.errno}] {error.strerror}"
    else:  # TensorFlow's: one line, without the name of its function and op
        reason = re.sub(r"\{\{function_node [^}]*\}\}|\[Op:\w+\]", "", " ".join(str(error).split())).strip()
    return (
        f"could not write {path}: {reason}. Free space or make it writable there (or choose another "
        f"--workdir), {_RESUME}"
    )


def note_unreadable(path, split):
    """Notes a `split` ("training" or "evaluation") file at `path` that cannot be read or decoded: an image,
    or a record file of prepared data (tensorflow-datasets' `*.tfrecord-NNNNN-of-NNNNN`) that cannot be
    read to its end."""
    if ".tfrecord" in os.path.basename(path):
        what, fix = "record file", f"Restore it from a copy or prepare the data set again with {COMMAND}"
        skip = " (or pass --skip_corrupt to leave out the records it cannot give)"
    else:
        what, fix = "image file", "Repair or remove it"
        skip = " (or pass --skip_corrupt to leave such training files out)"
    skip = skip if split == "training" else ""
    note(f"cannot read or decode the {split} {what} {path}. {fix}{skip}, {_RESUME}")


def write_atomically(path, write, mode="w"):
    """Writes the file `path` through `write(file)` into `<path>.tmp`, then renames it over `path`, so the
    file is whole or as it was. On an `OSError` the temporary file is removed and the failure noted.

    Returns:
        True when `path` was written.
    """
    tmp = f"{path}.tmp"
    try:
        with open(tmp, mode, **({} if "b" in mode else {"newline": ""})) as f:
            write(f)
        os.replace(tmp, path)
        return True
    except OSError as e:
        remove_quietly(tmp)
        note(write_failure(path, e))
        return False


def remove_quietly(*paths):
    """Removes the files `paths` that exist; a failure to remove one is ignored (it is left behind)."""
    for path in paths:
        try:
            os.remove(path)
        except OSError:
            pass


def vote():
    """This rank's vote for an allreduce: 1.0 when it noted a failure, else 0.0."""
    return 0.0 if _noted is None else 1.0


def raise_noted():
    """Raises `FileFailure` on every rank with the failure of the lowest rank that noted one; call it on
    every rank once a vote found one (a collective: one gather). The failure is then forgotten."""
    global _noted
    messages = collectives.gather_objects(_noted, name="hvd_lars.file_failure")
    _noted = None
    rank, message = next((r, m) for r, m in enumerate(messages) if m)
    where = f"rank {rank} of {len(messages)}: " if len(messages) > 1 else ""
    raise FileFailure(where + message)


def agree(name="hvd_lars.file_failure_vote"):
    """A collective: raises `FileFailure` on every rank when any rank noted a failure (`raise_noted`)."""
    if collectives.allreduce_sum([vote()], name=name)[0]:
        raise_noted()
