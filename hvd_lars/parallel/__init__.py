"""The Keras 3 layer for Horovod: every Horovod call (`collectives.py`), `DistributedOptimizer`
(`optimizer.py`), the Horovod-named callbacks (`callbacks.py`, the learning-rate ones in
`learning_rate_callbacks.py`), elastic state (`elastic.py`), Open MPI's allreduce rules for CPU ranks
(`ompi_allreduce_rules.py` and its `.conf`) and the `horovod.tensorflow.keras` namespace a ported script
imports (`horovod_keras.py`). Imports nothing of `hvd_lars.training`.
"""

import hvd_lars

hvd_lars.require(__name__)  # one line where TensorFlow cannot run
