"""Writes this folder's checkpoint (see README.md): run with the package of 46b66ab on PYTHONPATH."""

import sys

import keras
import numpy as np
import tensorflow as tf

from hvd_lars import LARS, DistributedOptimizer

out = sys.argv[1]
model = keras.Sequential(
    [keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones", bias_initializer="zeros")]
)
opt = DistributedOptimizer(LARS(0.1, momentum=0.9), backward_passes_per_step=2)
model.compile(optimizer=opt, loss="mse", jit_compile=False)
x = np.arange(9, dtype=np.float32).reshape(3, 3) / 10
y = np.ones((3, 2), np.float32)
model.fit(x, y, batch_size=1, shuffle=False, verbose=0)  # 3 micro-batches: one update, one pending
tf.train.Checkpoint(model=model, optimizer=opt).write(out + "/ckpt")
print(int(opt.iterations), int(opt._iterations))
