"""The Keras 3 core for Horovod: every Horovod call (`collectives.py`), `DistributedOptimizer`
(`optimizer.py`, `accumulation.py`), the broadcast and metric averaging (`callbacks.py`), Horovod's warmup
(`learning_rate_callbacks.py`), elastic state (`elastic.py`), Open MPI's allreduce rules for CPU ranks
(`ompi_allreduce_rules.py`); `horovod_keras/` sets `horovod.tensorflow.keras`'s names and defaults on it.
Imports nothing of `hvd_lars.training`."""

import hvd_lars

hvd_lars.require(__name__)  # one line where TensorFlow cannot run
