"""hvd_lars: large-batch data-parallel training of image classifiers with LARS, warmup and Horovod.

Reproduces You et al., "ImageNet Training in Minutes" (ICPP 2018). The pieces a Keras 3 user can take
alone: `LARS`, `WarmupPolynomialDecay`, `scaled_learning_rate`.
"""

from hvd_lars.lars import LARS, TRUST_RATIO_MODES, mlperf_exclusions
from hvd_lars.schedules import WarmupPolynomialDecay, epochs_to_steps, scaled_learning_rate

__version__ = "0.1.0"
__all__ = [
    "LARS",
    "TRUST_RATIO_MODES",
    "WarmupPolynomialDecay",
    "epochs_to_steps",
    "mlperf_exclusions",
    "scaled_learning_rate",
]
