"""The training application of `hvd_lars.main`; `hvd_lars.optim` and `.parallel` never import it."""

import hvd_lars

hvd_lars.require(__name__)  # one line where TensorFlow cannot run
