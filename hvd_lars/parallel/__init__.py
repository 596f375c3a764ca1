"""The Keras 3 layer for Horovod: every Horovod call (`collectives.py`), `DistributedOptimizer`
(`optimizer.py`), the Horovod-named callbacks (`callbacks.py`), elastic state (`elastic.py`) and the
`horovod.tensorflow.keras` namespace a ported script imports (`horovod_keras.py`). Imports nothing of
`hvd_lars.training`.
"""
