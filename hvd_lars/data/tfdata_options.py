"""The `tf.data.Options` every input pipeline of `hvd_lars.data` runs with: a fixed element order or not,
and a private pool of threads, so that AUTOTUNE cannot take the cores the training step uses."""

import os

import tensorflow as tf

from hvd_lars.parallel import collectives


def options(deterministic, threads=0):
    """`tf.data.Options`: order fixed or not; a private pool of `threads`, 0: the CPUs of this process's
    affinity mask divided among the ranks of its host (at least 1; the training program passes its own
    figure, `hvd_lars.training.threads.threads_per_rank`)."""
    opts = tf.data.Options()
    opts.deterministic = bool(deterministic)
    opts.threading.private_threadpool_size = threads or max(
        1, len(os.sched_getaffinity(0)) // collectives.local_size()
    )
    # One thread per op: parallelism comes from parallel elements, not from threads inside one decode.
    opts.threading.max_intra_op_parallelism = 1
    opts.autotune.enabled = True
    return opts
