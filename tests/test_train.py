"""hvd_lars.training.train's pieces that need no data: thread settings read back from TensorFlow."""

import pytest
import tensorflow as tf

from hvd_lars.training.config import TrainConfig
from hvd_lars.training.threads import applied_threads, configure_threads


@pytest.mark.unit
def test_thread_settings_are_read_back_from_tensorflow():
    tf.constant(1.0) + 1.0  # this process's TensorFlow is initialised: its pools are fixed
    before = applied_threads()
    requested = configure_threads(TrainConfig(intra_op_threads=7, inter_op_threads=3), world_size=1)
    assert requested == (7, 3)
    # The request came too late: what is reported is what TensorFlow runs with, not the request.
    assert applied_threads() == before
    assert (before["intra_op"], before["inter_op"]) != (7, 3)
    assert before["intra_op"] == tf.config.threading.get_intra_op_parallelism_threads()
