"""hvd_lars: large-batch data-parallel training of image classifiers with LARS, warmup and Horovod.

Reproduces You et al., "ImageNet Training in Minutes" (ICPP 2018). Two wings:

* the library, which other Keras 3 projects import: `hvd_lars.optim` (`LARS`, the warmup schedules,
  `scaled_learning_rate`, `LearningRateWarmup`) and `hvd_lars.parallel` (the Keras 3 replacement for
  `horovod.tensorflow.keras`: `DistributedOptimizer`, the Horovod-named callbacks, elastic state), beside
  `hvd_lars.models`, `hvd_lars.data` and `hvd_lars.metrics`;
* the training application, `hvd_lars.training`, started by `python -m hvd_lars.main`.

`import hvd_lars` imports the library wing (Keras with it), so that every Keras class the package defines is
registered for `keras.models.load_model`; it imports nothing of the application.
"""

__version__ = "0.1.0"

# Before Keras imports TensorFlow: without its C++ start-up notices (hvd_lars.quiet_tensorflow says which).
from hvd_lars import quiet_tensorflow  # noqa: E402

quiet_tensorflow.load()

# Registration for load_model is why these are eager imports (Keras comes with them).
from hvd_lars import metrics, models  # noqa: E402, F401
from hvd_lars.optim.lars import LARS, MOMENTUM_CORRECTIONS, TRUST_RATIO_MODES, mlperf_exclusions  # noqa: E402
from hvd_lars.optim.rate_callbacks import LearningRateLogger, LearningRateWarmup  # noqa: E402
from hvd_lars.optim.scaling import REFERENCE_BATCH, epochs_to_steps, scaled_learning_rate  # noqa: E402
from hvd_lars.optim.schedules import (  # noqa: E402
    SCHEDULES,
    PaperPolynomialDecay,
    WarmupCosineDecay,
    WarmupPolynomialDecay,
    WarmupStepDecay,
    make_schedule,
)
from hvd_lars.parallel.callbacks import (  # noqa: E402
    BroadcastGlobalVariablesCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
)
from hvd_lars.parallel.optimizer import DistributedLossScaleOptimizer, DistributedOptimizer  # noqa: E402

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "DistributedLossScaleOptimizer",
    "DistributedOptimizer",
    "LARS",
    "LearningRateLogger",
    "LearningRateWarmup",
    "LearningRateWarmupCallback",
    "MOMENTUM_CORRECTIONS",
    "MetricAverageCallback",
    "PaperPolynomialDecay",
    "REFERENCE_BATCH",
    "SCHEDULES",
    "TRUST_RATIO_MODES",
    "WarmupCosineDecay",
    "WarmupPolynomialDecay",
    "WarmupStepDecay",
    "epochs_to_steps",
    "make_schedule",
    "mlperf_exclusions",
    "scaled_learning_rate",
]
