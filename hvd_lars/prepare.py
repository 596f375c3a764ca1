"""Command line: `hvd-lars-prepare DATASET --manual_dir=DIR --data_dir=DIR` (or `python -m hvd_lars.prepare`).

Prepares a data set once, on one node, before the training jobs that read it:

    hvd-lars-prepare imagenet2012 --manual_dir=/data/imagenet-tars --data_dir=/data/tfds
    launch/mpirun.sh hostfile 512 flags/resnet50_bs32k_lars.flags --data_dir=/data/tfds

For `imagenet2012` it converts the two ILSVRC-2012 tars into tensorflow-datasets records under `--data_dir`
(`hvd_lars.data.imagenet_preparation.prepare`: hours on the full set); an interrupted run leaves nothing
that counts as prepared, and the same command run again starts afresh. The other data sets need no
preparation and say so in one line. Exit status: 0 when the data are prepared (now or before) or need
none, 2 on bad input (one line `hvd_lars: error: ...`, before TensorFlow is imported where the arguments
alone are wrong), 130 when interrupted (Ctrl-C).
"""

import argparse
import datetime
import logging
import os
import sys
import time

from hvd_lars.training.config import DATASETS

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
log = logging.getLogger("hvd_lars")


class Refused(ValueError):
    """Bad input: a name that is not one of `hvd_lars.data.DATASETS`, a --data_dir that is not a folder, or
    what the preparation refuses before it converts anything."""


# Why the data sets without a preparation need none (one line each; every other name of DATASETS prepares).
NO_PREPARATION = {
    "fashion_mnist": "training reads the four IDX files of Debian's dataset-fashion-mnist as they are",
    "image_folder": "training reads the JPEG folders (train/<class>/, validation/<class>/) as they are",
    "synthetic": "its images are made in memory",
}


def prepare_imagenet(manual_dir, data_dir):
    """Prepares `imagenet2012` (unless prepared); logs where the records are and how to train on them."""
    from hvd_lars import quiet_tensorflow

    quiet_tensorflow.load()  # before TensorFlow is imported: without its C++ start-up notices
    from hvd_lars.data import imagenet_preparation as imagenet

    ds_builder = imagenet.builder(data_dir)
    root = os.path.abspath(ds_builder.data_dir_root)
    if imagenet.unfinished(ds_builder) is None:
        _report(ds_builder, root, "is prepared already")
        return

    def starting(folder, removed):
        if removed:
            log.info("removed what interrupted preparations left: %s", ", ".join(removed))
        log.info(
            "preparing imagenet2012 from --manual_dir=%s into %s, once: hours for the full ILSVRC-2012 "
            "(1,281,167 training and 50,000 validation images; %s, unlabelled, is converted too when "
            "there). If it is interrupted, nothing counts as prepared: run this command again.",
            manual_dir,
            folder,
            imagenet.OPTIONAL_FILE,
        )

    start = time.monotonic()
    try:
        done = imagenet.prepare(manual_dir, data_dir, starting)
    except imagenet.CannotPrepare as e:  # bad input, found before anything is converted
        raise Refused(str(e)) from e
    took = datetime.timedelta(seconds=round(time.monotonic() - start))
    _report(done.builder, root, f"prepared in {took} (h:mm:ss)" if done.converted else "is prepared")


def _report(ds_builder, root, what):
    splits = ds_builder.info.splits
    log.info(
        f"imagenet2012 {what} under {ds_builder.data_path}: {splits['train'].num_examples:,} training and "
        f"{splits['validation'].num_examples:,} validation images."
    )
    log.info(
        f"train on it with --dataset=imagenet2012 --data_dir={root} (the ImageNet flagfiles set the "
        f"dataset), e.g. launch/mpirun.sh hostfile 512 flags/resnet50_bs32k_lars.flags --data_dir={root}"
    )


# The data sets without a preparation whose files training reads from --data_dir as they are.
READ_IN_PLACE = ("fashion_mnist", "image_folder")
# The data sets this command prepares: name -> callable(manual_dir, data_dir).
PREPARATIONS = {"imagenet2012": prepare_imagenet}


def run(dataset, manual_dir="", data_dir=""):
    """Prepares `dataset` (a name of `hvd_lars.data.DATASETS`), or says in one line that it needs nothing.
    Raises Refused (listing the valid names; a `data_dir` that is not a folder, where one is read; what
    the preparation refuses before it converts anything) or ImportError (no tensorflow-datasets)."""
    if dataset not in DATASETS:
        raise Refused(f"unknown data set {dataset!r}; valid: {', '.join(DATASETS)}.")
    if dataset in READ_IN_PLACE and data_dir and not os.path.isdir(data_dir):
        raise Refused(f"--data_dir={data_dir}: no such folder ({dataset} reads its data there).")
    if dataset not in PREPARATIONS:
        log.info("%s needs no preparation: %s.", dataset, NO_PREPARATION[dataset])
        return
    PREPARATIONS[dataset](manual_dir or None, data_dir or None)


def main(argv=None):
    from hvd_lars.main import configure_logging

    parser = argparse.ArgumentParser(
        prog="hvd-lars-prepare",
        description="\n\n".join(__doc__.split("\n\n")[1:3]),  # what it does, and the example
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dataset", help=f"the data set to prepare: {', '.join(DATASETS)}")
    parser.add_argument(
        "--manual_dir",
        default="",
        help="imagenet2012: the folder holding ILSVRC-2012's training and validation tars (image-net.org)",
    )
    parser.add_argument(
        "--data_dir",
        default="",
        help="where the prepared data go; training then reads them with the same --data_dir "
        "(default: tensorflow-datasets' folder, ~/tensorflow_datasets, as for training)",
    )
    configure_logging()

    def one_line(message):  # argparse's usage and error lines, as one
        log.error("%s (data sets: %s; hvd-lars-prepare --help says more)", message, ", ".join(DATASETS))
        sys.exit(EXIT_BAD_INPUT)

    parser.error = one_line
    args = parser.parse_args(argv)
    try:
        run(args.dataset, args.manual_dir, args.data_dir)
    except (Refused, ImportError) as e:
        log.error("%s", e)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        log.error("interrupted: nothing new counts as prepared; run the same command again.")
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
