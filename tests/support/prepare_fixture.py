"""`hvd_lars.prepare` on the tests' small ILSVRC-style tars, run as a process of its own.

    python -m tests.support.prepare_fixture LABELS [--stop_after_first_records=MARKER] -- ARGUMENTS...

runs `hvd-lars-prepare ARGUMENTS...` with tensorflow-datasets' validation label file replaced by LABELS (the
fixture's validation tar holds the first N of the 50,000 images). With --stop_after_first_records, once the
first split's record files are written the process writes MARKER (their folder) and waits for a signal.
"""

import os
import signal
import sys

from tensorflow_datasets.core import writer
from tensorflow_datasets.datasets.imagenet2012 import imagenet_common

from hvd_lars import prepare


def _stop_after_first_records(marker):
    finalize = writer.Writer.finalize  # tensorflow-datasets 4.9: writes a split's record files

    def finalize_then_wait(self):
        finalize(self)
        with open(marker + ".part", "w") as f:
            f.write(os.fspath(self._filename_template.data_dir))
        os.replace(marker + ".part", marker)  # whole, or not there
        while True:
            signal.pause()

    writer.Writer.finalize = finalize_then_wait


def main(argv):
    split = argv.index("--")
    (labels, *rest), arguments = argv[1:split], argv[split + 1 :]
    # Read by both the builder and hvd_lars' check (tfds_path of an absolute path is that path).
    imagenet_common._VALIDATION_LABELS_FNAME = labels
    for option in rest:
        name, _, value = option.partition("=")
        if name != "--stop_after_first_records":
            raise SystemExit(f"unknown option {option!r}")
        _stop_after_first_records(value)
    return prepare.main(arguments)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
