"""The main program on one rank, then this rank's final weights to a file (for the multi-host tests).

Usage (cwd anywhere; launched once per rank like `python -m hvd_lars.main`):
    python tests/support/rank_weights_main.py --flagfile=flags/smoke.flags [flags...]
Runs `hvd_lars.main` unchanged and, after training, writes <workdir>/<run_name>/rank_weights/rank<r>.npz
with the model's trainable weights (t0, t1, ...) and other float weights (n0, ...; batch-norm moving
statistics), in `model.weights` order, and the same weights as this rank built them before training
(init_t0, ..., init_n0, ...; rank 0's are the run's initial weights, which the first batch broadcasts).
The main program checkpoints on rank 0 only, so this is how a test sees that every rank ends with the same
weights. Imports hvd_lars from the checkout that holds this file.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

import hvd_lars.main  # noqa: E402
import hvd_lars.models  # noqa: E402
import hvd_lars.training.train  # noqa: E402
from hvd_lars.parallel import collectives  # noqa: E402

_models = []
_initial = []
_get_model = hvd_lars.models.get_model
_run = hvd_lars.training.train.run


def _recording_get_model(*args, **kwargs):
    model = _get_model(*args, **kwargs)
    _models.append(model)
    _initial.append(_arrays(model))
    return model


def _arrays(model):
    others = [v for v in model.non_trainable_weights if "seed_generator" not in v.path]
    arrays = {f"t{i}": v.numpy() for i, v in enumerate(model.trainable_weights)}
    arrays.update({f"n{i}": v.numpy() for i, v in enumerate(others)})
    return arrays


def _run_and_save(config):
    summary = _run(config)
    model = _models[-1]
    out = os.path.join(config.workdir, summary["run_name"], "rank_weights")
    os.makedirs(out, exist_ok=True)
    arrays = _arrays(model)
    arrays.update({f"init_{name}": value for name, value in _initial[-1].items()})
    np.savez(os.path.join(out, f"rank{collectives.rank()}.npz"), **arrays)
    return summary


hvd_lars.models.get_model = _recording_get_model
hvd_lars.training.train.run = _run_and_save

if __name__ == "__main__":
    hvd_lars.main.main()
