"""ImageNet-1k's one-time preparation: the user's ILSVRC-2012 tars converted into tensorflow-datasets'
`imagenet2012` records under `data_dir` (`hvd-lars-prepare imagenet2012`, `hvd_lars.prepare`), and the
test of whether a folder holds a finished one.

The user's `MANUAL_FILES` (from image-net.org) sit in a manual folder; nothing is downloaded. An
interrupted conversion leaves only tensorflow-datasets' `incomplete.*` folder, which the next run removes;
training reads only a finished one (`unfinished`, `prepared_builder`).
"""

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import re
import shutil
import tarfile
import tempfile

NAME = "imagenet2012"
MANUAL_FILES = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")
# Converted as well when present (100,000 unlabelled images); training does not read it.
OPTIONAL_FILE = "ILSVRC2012_img_test.tar"
SPLITS = ("train", "validation")
# The two files a finished conversion writes last, besides the records (tensorflow-datasets'
# `file_utils.is_valid_variant_dir` looks for the first).
INFO_FILES = ("dataset_info.json", "features.json")
# ILSVRC-2012 validation file names: ILSVRC2012_val_00000001.JPEG ... ILSVRC2012_val_00050000.JPEG.
VALIDATION_NAME = "ILSVRC2012_val_{:08d}.JPEG"
# The folder an unfinished conversion writes into: tensorflow-datasets 4.9's `file_utils._get_incomplete_dir`
# (`constants.INCOMPLETE_PREFIX` "incomplete.", 6 random upper-case letters or digits, "_", the version).
INCOMPLETE_FOLDER = re.compile(r"^incomplete\.[A-Z0-9]{6}_\d+\.\d+\.\d+$")
# Held in the dataset's folder while one preparation converts (tensorflow-datasets ignores it there).
LOCK_NAME = ".hvd_lars_prepare.lock"
COMMAND = "hvd-lars-prepare"
_TARS = " and ".join(MANUAL_FILES)


class NotPrepared(FileNotFoundError):
    """`data_dir` holds no finished preparation of ImageNet; the message names the command that makes one."""


class CannotPrepare(ValueError):
    """The preparation is refused before it converts anything (missing or wrong tars, a folder that cannot
    be written or lacks the space, another preparation at work, a damaged earlier one)."""


def tfds_module():
    """The `tensorflow_datasets` module, or an ImportError saying how to install it."""
    try:
        import tensorflow_datasets as tfds  # optional extra: hvd_lars.data must import without it
    except ImportError as e:
        raise ImportError(
            f"--dataset=imagenet2012 needs tensorflow-datasets ({e}); install the extra: "
            "pip install 'hvd_lars[imagenet]' (or pip install -r requirements.txt)."
        ) from e
    return tfds


def default_data_dir():
    """The folder ImageNet is prepared into and read from when --data_dir is empty: tensorflow-datasets'
    default, $TFDS_DATA_DIR or else ~/tensorflow_datasets (its documented rule; `get_default_data_dir` of
    tensorflow-datasets 4.9's `core.constants`), found without importing it."""
    return os.environ.get("TFDS_DATA_DIR", os.path.join(os.path.expanduser("~"), "tensorflow_datasets"))


def builder(data_dir=None):
    """tensorflow-datasets' `imagenet2012` builder over `data_dir` (None: its default folder), as it is:
    prepared or not (see `prepared_builder`)."""
    tfds = tfds_module()
    # For a dataset not prepared, tensorflow-datasets 4.9 makes a temporary folder it never removes
    # (`DatasetInfo.initialize_from_bucket`): made here in one that is removed.
    with tempfile.TemporaryDirectory() as scratch:
        kept, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            return tfds.builder(NAME, data_dir=data_dir or None)
        finally:
            tempfile.tempdir = kept


def command(data_dir=None, manual_dir=None):
    """The command line that prepares ImageNet into `data_dir` (None: the default folder, training's too)
    from `manual_dir` (None: a placeholder naming the two tars)."""
    manual = manual_dir or f"<folder holding {_TARS}>"
    return f"{COMMAND} {NAME} --manual_dir={manual}" + (f" --data_dir={data_dir}" if data_dir else "")


def unfinished(ds_builder):
    """None when the builder's folder holds what a finished preparation leaves, else what it lacks."""
    folder = os.fspath(ds_builder.data_path)
    if not os.path.isdir(folder):
        parent = os.path.dirname(folder)
        left = sorted(filter(INCOMPLETE_FOLDER.match, os.listdir(parent))) if os.path.isdir(parent) else []
        if left:
            return f"there is no {folder}, only {', '.join(left)} of a preparation at work or interrupted"
        return f"there is no {folder}"
    present = set(os.listdir(folder))
    lacking = [name for name in INFO_FILES if name not in present]
    if lacking:
        return f"{folder} lacks {', '.join(lacking)}"
    splits = ds_builder.info.splits
    absent = [split for split in SPLITS if split not in splits]
    if absent:
        return f"{folder} holds no {' or '.join(absent)} split (it was prepared without {_TARS})"
    missing = [name for split in SPLITS for name in splits[split].filenames if name not in present]
    if missing:
        return f"{folder} lacks {len(missing)} of its record files ({', '.join(missing[:3])})"
    return None


def prepared_builder(data_dir=None):
    """The `imagenet2012` builder over a prepared `data_dir`; checks only. Raises NotPrepared (naming the
    command that prepares it there) or ImportError (no tensorflow-datasets)."""
    ds_builder = builder(data_dir)
    problem = unfinished(ds_builder)
    if problem:
        root = os.path.abspath(ds_builder.data_dir_root)
        raise NotPrepared(
            f"ImageNet is not prepared under --data_dir={root} ({problem}). Prepare it once, on one node, "
            f"before training: {command(root)}; then train with the same --data_dir."
        )
    return ds_builder


def validation_labels_path():
    """The validation label file tensorflow-datasets' builder reads (one synset per line, line i labelling
    `ILSVRC2012_val_<i>.JPEG`; 50,000 lines)."""
    tfds = tfds_module()
    from tensorflow_datasets.datasets.imagenet2012 import imagenet_common  # optional extra, as tfds_module

    return os.fspath(tfds.core.tfds_path(imagenet_common._VALIDATION_LABELS_FNAME))


def check_validation_tar(val_tar, labels_path=None):
    """N, the validation images of `val_tar`, which must hold exactly the names `VALIDATION_NAME` of 1..N
    whose labels are the N lines of `labels_path` (default `validation_labels_path()`): tensorflow-datasets
    labels them by position in the tar's sorted names, so a missing or extra entry would shift every later
    label. Raises CannotPrepare naming the names missing and extra, with their counts."""
    labels_path = labels_path or validation_labels_path()
    with open(labels_path) as f:
        count = len(f.read().strip().splitlines())
    expected = {VALIDATION_NAME.format(i) for i in range(1, count + 1)}
    with tarfile.open(val_tar, "r:") as tar:
        names = set(tar.getnames())  # every entry, folders included, as the builder sorts them
    missing, extra = sorted(expected - names), sorted(names - expected)
    if missing or extra:

        def some(items):
            shown = ", ".join(items[:5])
            return f"{len(items):,} ({shown}{', ...' if len(items) > 5 else ''})" if items else "none"

        raise CannotPrepare(
            f"{val_tar} does not hold exactly the {count:,} validation images the label file {labels_path} "
            f"covers ({VALIDATION_NAME.format(1)} to {VALIDATION_NAME.format(count)}): missing "
            f"{some(missing)}; extra {some(extra)}. tensorflow-datasets labels them by position in the "
            "sorted list, so any other set would be labelled wrongly. Use the complete "
            "ILSVRC2012_img_val.tar (50,000 JPEGs) from https://image-net.org."
        )
    return count


@dataclasses.dataclass
class Preparation:
    """What `prepare` did: `converted` False when prepared already; `removed`, the folders interrupted
    preparations had left."""

    builder: object
    converted: bool
    removed: list


def prepare(manual_dir, data_dir=None, starting=None):
    """Converts the tars in `manual_dir` into `imagenet2012` records under `data_dir`, unless prepared.

    First it checks that both tars are there, that `data_dir` can be written and has room for the tars'
    size, that the validation tar holds exactly the labelled images (`check_validation_tar`), that no other
    preparation writes there (`LOCK_NAME`, held while converting) and that no damaged earlier preparation
    is in the way; then it removes what interrupted preparations left (`INCOMPLETE_FOLDER`).

    `manual_dir` holds `MANUAL_FILES` (and, converted too when there, `OPTIONAL_FILE`); `data_dir` None:
    tensorflow-datasets' default. `starting(folder, removed)`, when given, is called once the checks have
    passed, before converting into `folder` (the version folder). Returns a `Preparation`.

    Raises:
        CannotPrepare: as listed above, before any record is written.
        ImportError: tensorflow-datasets is not installed.
    """
    tfds = tfds_module()
    ds_builder = builder(data_dir)
    if unfinished(ds_builder) is None:
        return Preparation(ds_builder, converted=False, removed=[])
    root = os.path.abspath(ds_builder.data_dir_root)
    tars = _tars(manual_dir, root)
    with _exclusive(os.path.dirname(os.fspath(ds_builder.data_path)), root):
        ds_builder = builder(data_dir)  # another preparation may have finished meanwhile
        problem = unfinished(ds_builder)
        if problem is None:
            return Preparation(ds_builder, converted=False, removed=[])
        if os.path.isdir(os.fspath(ds_builder.data_path)):
            raise CannotPrepare(
                f"{problem}: a preparation that did not finish, or files removed since. tensorflow-datasets "
                f"would reuse that folder as it is: remove it (rm -r {ds_builder.data_path}) and run "
                f"{command(root, manual_dir)} again."
            )
        needed, free = sum(os.path.getsize(path) for path in tars), shutil.disk_usage(root).free
        if free < needed:  # the records hold the same JPEG bytes, a few re-encoded
            raise CannotPrepare(
                f"--data_dir={root} has {free / 1e9:,.1f} GB free; the records need about "
                f"{needed / 1e9:,.1f} GB (the size of {', '.join(os.path.basename(p) for p in tars)}). Free "
                "some space or prepare into another folder."
            )
        check_validation_tar(tars[1])
        folder = os.path.dirname(os.fspath(ds_builder.data_path))
        removed = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if INCOMPLETE_FOLDER.match(n)]
        removed = [path for path in removed if os.path.isdir(path)]
        for path in removed:
            shutil.rmtree(path)
        if starting:
            starting(os.fspath(ds_builder.data_path), removed)
        config = tfds.download.DownloadConfig(
            manual_dir=manual_dir,
            try_download_gcs=False,  # nothing is downloaded: the records come from the tars alone
            # Statistics are only for the catalogue; computing them reads the whole set again.
            compute_stats=tfds.download.ComputeStatsMode.SKIP,
        )
        ds_builder.download_and_prepare(download_config=config)
    return Preparation(prepared_builder(data_dir), converted=True, removed=removed)


def _tars(manual_dir, root):
    """The tars of `manual_dir` the conversion reads (the two of `MANUAL_FILES`, then `OPTIONAL_FILE` when
    there). Raises CannotPrepare naming the folder and the two files when one is missing."""
    missing = [f for f in MANUAL_FILES if not manual_dir or not os.path.isfile(os.path.join(manual_dir, f))]
    if missing:
        where = (
            f"--manual_dir={manual_dir} lacks {' and '.join(missing)}" if manual_dir else "no --manual_dir"
        )
        raise CannotPrepare(
            f"ImageNet is not prepared under --data_dir={root}, and {where}. Download {_TARS} from "
            "https://image-net.org (registration needed), put both in one folder and run "
            f"{command(root)}."
        )
    paths = [os.path.join(manual_dir, name) for name in (*MANUAL_FILES, OPTIONAL_FILE)]
    return paths if os.path.isfile(paths[-1]) else paths[:-1]


@contextlib.contextmanager
def _exclusive(folder, root):
    """Creates `folder` and holds its `LOCK_NAME` while the block runs; CannotPrepare when `folder` cannot
    be written or another process holds the lock."""
    path = os.path.join(folder, LOCK_NAME)
    try:
        os.makedirs(folder, exist_ok=True)
        handle = open(path, "a")
    except OSError as e:
        raise CannotPrepare(
            f"cannot write --data_dir={root} ({e.strerror}: {e.filename}). Prepare into a folder you may "
            "write, and train with that --data_dir."
        ) from e
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when the process ends, however
        except BlockingIOError as e:
            raise CannotPrepare(
                f"another preparation is writing ImageNet into --data_dir={root} (it holds {path}): wait for "
                "it to finish, or stop it and run this command again."
            ) from e
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
                raise
            # E.g. Lustre mounted without -o flock: nothing can tell a second preparation here.
            logging.getLogger(__name__).warning(
                "%s cannot be locked (%s); run one preparation at a time there.", path, e
            )
        yield
