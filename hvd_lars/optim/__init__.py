"""The optimizer wing of the library: `LARS` (`lars.py`), learning-rate schedules with warmup (`schedules.py`,
built on the pure functions of `rate_curves.py`), the linear scaling rule and epoch/step conversion
(`scaling.py`) and the warmup callbacks for optimizers with a float rate (`rate_callbacks.py`). Imports
nothing of `hvd_lars.training`.
"""
