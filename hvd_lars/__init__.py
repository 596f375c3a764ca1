"""hvd_lars: large-batch data-parallel training of image classifiers with LARS, warmup and Horovod
(You et al., "ImageNet Training in Minutes", ICPP 2018). The library (`hvd_lars.optim`, `hvd_lars.parallel`,
`hvd_lars.models`, `hvd_lars.data`, `hvd_lars.metrics`) and the training application (`hvd_lars.training`,
`python -m hvd_lars.main`); docs/development.md lays them out.

`import hvd_lars` registers every Keras class the package defines for `keras.models.load_model`.
"""

import importlib
import os
import sys

__version__ = "0.1.0"

# Each public name and the module that defines it.
_EXPORTS = {
    "BroadcastGlobalVariablesCallback": "hvd_lars.parallel.callbacks",
    "DistributedLossScaleOptimizer": "hvd_lars.parallel.optimizer",
    "DistributedOptimizer": "hvd_lars.parallel.optimizer",
    "FusedBatchNormalization": "hvd_lars.models.batch_norm",
    "LARS": "hvd_lars.optim.lars",
    "LearningRateLogger": "hvd_lars.optim.rate_callbacks",
    "LearningRateWarmup": "hvd_lars.optim.rate_callbacks",
    "LearningRateWarmupCallback": "hvd_lars.parallel.callbacks",
    "MOMENTUM_CORRECTIONS": "hvd_lars.optim.lars",
    "MetricAverageCallback": "hvd_lars.parallel.callbacks",
    "PaperPolynomialDecay": "hvd_lars.optim.schedules",
    "REFERENCE_BATCH": "hvd_lars.optim.scaling",
    "SCHEDULES": "hvd_lars.optim.schedules",
    "TRUST_RATIO_MODES": "hvd_lars.optim.lars",
    "WarmupCosineDecay": "hvd_lars.optim.schedules",
    "WarmupPolynomialDecay": "hvd_lars.optim.schedules",
    "WarmupStepDecay": "hvd_lars.optim.schedules",
    "epochs_to_steps": "hvd_lars.optim.scaling",
    "fuse_batch_norm": "hvd_lars.models.batch_norm",
    "make_schedule": "hvd_lars.optim.schedules",
    "mlperf_exclusions": "hvd_lars.optim.lars",
    "scaled_learning_rate": "hvd_lars.optim.scaling",
}
# The other modules that define Keras classes a saved model may hold.
_REGISTERING = ("hvd_lars.metrics", "hvd_lars.models")
# What needs TensorFlow; the rest runs on every Keras 3 backend. Horovod is needed by none at import: without
# it, `hvd_lars.parallel` and the training program are one process of world size 1 (`collectives.init`).
_TENSORFLOW_ONLY = ("hvd_lars.parallel", "hvd_lars.models", "hvd_lars.data", "hvd_lars.training")

__all__ = sorted(_EXPORTS)


def _backend():
    keras = sys.modules.get("keras")  # asked without importing Keras (the training program imports it late)
    return keras.backend.backend() if keras else os.environ.get("KERAS_BACKEND", "tensorflow")


def _available(module):
    return _backend() == "tensorflow" or not module.startswith(_TENSORFLOW_ONLY)


def require(module):
    """Raises ImportError, in one line, where `module` (a part that needs TensorFlow) cannot run."""
    import importlib.util

    missing = importlib.util.find_spec("tensorflow") is None
    if missing or _backend() != "tensorflow":
        raise ImportError(
            f"{module} needs tensorflow under Keras's TensorFlow backend (tensorflow "
            f"{'missing' if missing else 'installed'}; backend: {_backend()}): pip install "
            "'hvd_lars[train]', KERAS_BACKEND unset. LARS, the schedules, the rate callbacks and the metrics "
            "run on every backend."
        )


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _available(_EXPORTS[name]):
        require(_EXPORTS[name])
    for module in _REGISTERING:
        if _available(module):
            importlib.import_module(module)
    for export, module in _EXPORTS.items():
        if _available(module):
            globals()[export] = getattr(importlib.import_module(module), export)
    return globals()[name]


def __dir__():
    return sorted([*globals(), *_EXPORTS])


def _command_line_program():
    # The training program and the preparation check their arguments before Keras and TensorFlow are
    # imported. While `python -m hvd_lars.main` imports this package, sys.argv[0] is "-m" (being located).
    modules = {"hvd_lars.main", "hvd_lars.prepare"} & set(getattr(sys, "orig_argv", ()))
    scripts = ("hvd-lars-train", "hvd-lars-prepare")
    return (
        bool(sys.argv[:1] == ["-m"] and modules)
        or os.path.basename(sys.argv[0] if sys.argv else "") in scripts
    )


if not _command_line_program():
    try:
        __getattr__("LARS")
    except ModuleNotFoundError as e:  # Keras's default backend without TensorFlow: say what to do
        if e.name != "tensorflow" or _backend() != "tensorflow":
            raise
        raise ImportError(
            "Keras's backend is TensorFlow (KERAS_BACKEND unset), which is not installed: pip install "
            "'hvd_lars[train]', or set KERAS_BACKEND=jax (or torch) with that package installed."
        ) from None
