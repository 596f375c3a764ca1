"""hvd_lars: large-batch data-parallel training of image classifiers with LARS, warmup and Horovod.

Reproduces You et al., "ImageNet Training in Minutes" (ICPP 2018). The pieces a Keras 3 user can take
alone: `LARS`, the warmup schedules (`WarmupPolynomialDecay`, `PaperPolynomialDecay`, `WarmupCosineDecay`,
`WarmupStepDecay`, `make_schedule`), `scaled_learning_rate`, the callbacks in `hvd_lars.callbacks`, and the
Keras 3 replacements for `horovod.tensorflow.keras`: `DistributedOptimizer` and the callbacks of
`hvd_lars.horovod_callbacks`.
"""

import importlib

__version__ = "0.1.0"

# Public names and the module each lives in. Imported on first use (PEP 562), so that light tools of the
# package (hvd_lars.slurm_hosts, hvd_lars.main --help) do not pay TensorFlow's start-up.
_EXPORTS = {
    "LARS": "hvd_lars.lars",
    "DistributedOptimizer": "hvd_lars.distributed_optimizer",
    "DistributedLossScaleOptimizer": "hvd_lars.distributed_optimizer",
    "BroadcastGlobalVariablesCallback": "hvd_lars.horovod_callbacks",
    "MetricAverageCallback": "hvd_lars.horovod_callbacks",
    "LearningRateWarmupCallback": "hvd_lars.horovod_callbacks",
    "TRUST_RATIO_MODES": "hvd_lars.lars",
    "mlperf_exclusions": "hvd_lars.lars",
    "WarmupPolynomialDecay": "hvd_lars.schedules",
    "PaperPolynomialDecay": "hvd_lars.schedules",
    "WarmupCosineDecay": "hvd_lars.schedules",
    "WarmupStepDecay": "hvd_lars.schedules",
    "make_schedule": "hvd_lars.schedules",
    "SCHEDULES": "hvd_lars.schedules",
    "epochs_to_steps": "hvd_lars.schedules",
    "scaled_learning_rate": "hvd_lars.schedules",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hvd_lars' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
