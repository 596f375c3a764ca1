"""Files a run reads back at a start that are found cut short, empty or of another format (checkpoints that
cannot be read and their index, summary.json, metrics.csv, TensorBoard event files): each is moved under
`<run_dir>/damaged/`, never deleted, with a one-line warning naming it and saying what the run does instead
(falls back to an older checkpoint, rebuilds the file); the readers call `set_aside`. Sound files of another
run are no damage: `hvd_lars.training.lineage` keeps them under `earlier_runs/`."""

import logging
import os
import shutil

log = logging.getLogger(__name__)

FOLDER = "damaged"


def warn(message):
    """One warning line of the run log (`[hvd_lars] warning: <message>`)."""
    log.warning(message)


def set_aside(path, run_dir, copy=False):
    """Moves (or, with `copy`, copies) the file `path` inside `run_dir` to the same relative path under
    `<run_dir>/damaged/` (with `.1`, `.2`, ... appended when that name is taken); returns the new path."""
    rel = os.path.relpath(path, run_dir)
    if rel.startswith(os.pardir):
        rel = os.path.basename(path)
    target = os.path.join(run_dir, FOLDER, rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    candidate, n = target, 0
    while os.path.exists(candidate):
        n += 1
        candidate = f"{target}.{n}"
    (shutil.copy2 if copy else shutil.move)(path, candidate)
    return candidate
