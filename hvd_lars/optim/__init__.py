"""The optimizer wing of the library: `LARS` (`lars.py`), learning-rate schedules with warmup (`schedules.py`,
built on the pure functions of `rate_curves.py`), the linear scaling rule and epoch/step conversion
(`scaling.py`) and the warmup callbacks for optimizers with a float rate (`rate_callbacks.py`). Imports
nothing of `hvd_lars.training`.
"""

import sys

from hvd_lars.optim import rate_curves

# The module's name before issue 36 (`hvd_lars.optim.schedule_functions`), kept importable.
schedule_functions = rate_curves
sys.modules[__name__ + ".schedule_functions"] = rate_curves
