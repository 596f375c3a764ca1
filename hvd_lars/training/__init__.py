"""The training application started by `python -m hvd_lars.main` (`hvd-lars-train`); the library wing
(`hvd_lars.optim`, `hvd_lars.parallel`) never imports it."""

import hvd_lars

hvd_lars.require(__name__)  # one line where TensorFlow cannot run
