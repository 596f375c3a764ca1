"""Listing an image folder (`<split>/<class>/<image>`) as users' folders really are, and its index file.

The rules are docs/training.md's "Image folders" (labels: the training class folders in sorted order;
`HIDDEN_NAMES` skipped; `IMAGE_EXTENSIONS` in any case); anything else is one `ValueError` naming the paths
(up to `SHOWN` per kind). Paths go to TensorFlow as the file system's bytes (`os.fsencode`).

`listed(root, index_path)` saves the listing and reuses it while every folder it read keeps its device,
inode and modification time (one `stat` per folder instead of reading every name). Adding, removing or
renaming an entry changes its folder's modification time; rewriting a file in place does not (its new
bytes are read); a change within the second of the listing is missed where times are whole seconds.
"""

import collections
import dataclasses
import io
import logging
import os
import zipfile

import numpy as np

# Decoded by tf.io.decode_image / decode_jpeg (TensorFlow 2.21: JPEG, PNG, GIF, BMP, WebP); compared in
# lower case.
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".jpe", ".png", ".gif", ".bmp", ".webp")
# Hidden although their names do not start with "." (compared in lower case).
HIDDEN_NAMES = frozenset({"__macosx", "thumbs.db", "desktop.ini"})
# Paths shown per kind of problem in an error message.
SHOWN = 5
# Bump when the listing rules change: an index written under other rules is listed again.
INDEX_VERSION = 1
log = logging.getLogger(__name__)


def is_hidden(name):
    """True for names a listing skips: a leading "." or one of `HIDDEN_NAMES`."""
    return name.startswith(".") or name.lower() in HIDDEN_NAMES


@dataclasses.dataclass(frozen=True)
class Listing:
    """The images of one split folder `root`: `files` relative to it ("<class>/<name>", undecodable bytes
    escaped as `os.fsdecode` does) sorted by (label, path), their int32 `labels`, the `classes` (index =
    label), the `folders` read ((path relative to root, st_dev, st_ino, st_mtime_ns), what `unchanged`
    compares), and whether the classes were given to `list_split` (a validation split)."""

    root: str
    files: tuple
    labels: np.ndarray
    classes: tuple
    folders: tuple
    given_classes: bool = False

    def paths(self):
        """Full paths of `files` as bytes (what TensorFlow reads), in order."""
        root = os.fsencode(self.root)
        return [os.path.join(root, os.fsencode(f)) for f in self.files]

    def unchanged(self):
        """True when every folder read still has its device, inode and modification time."""
        for rel, dev, ino, mtime in self.folders:
            try:
                st = os.stat(os.path.join(self.root, rel))
            except OSError:
                return False
            if (st.st_dev, st.st_ino, st.st_mtime_ns) != (dev, ino, mtime):
                return False
        return True

    def to_bytes(self):
        """The listing as the bytes of an `.npz` file (the index file; also what rank 0 broadcasts)."""
        stats = np.array([f[1:] for f in self.folders], np.int64).reshape(-1, 3)
        out = io.BytesIO()
        np.savez(
            out,
            version=np.int64(INDEX_VERSION),
            root=_blob([self.root]),
            files=_blob(self.files),
            labels=self.labels.astype(np.int32),
            classes=_blob(self.classes),
            folder_paths=_blob(f[0] for f in self.folders),
            folder_stats=stats,
            given_classes=np.bool_(self.given_classes),
        )
        return out.getvalue()

    @classmethod
    def from_bytes(cls, data):
        """The listing `to_bytes` wrote, or None under other rules (`INDEX_VERSION`); numpy's ValueError or
        OSError when `data` is no such file."""
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            if int(z["version"]) != INDEX_VERSION:
                return None
            stats = z["folder_stats"].tolist()
            folders = tuple((p, *s) for p, s in zip(_unblob(z["folder_paths"]), stats))
            return cls(
                root=_unblob(z["root"])[0],
                files=tuple(_unblob(z["files"])),
                labels=z["labels"],
                classes=tuple(_unblob(z["classes"])),
                folders=folders,
                given_classes=bool(z["given_classes"]),
            )


def _blob(strings):
    # NUL never occurs in a path; one uint8 array loads far faster than an array of objects.
    return np.frombuffer(b"\0".join(os.fsencode(s) for s in strings), np.uint8)


def _unblob(array):
    data = array.tobytes()
    return [os.fsdecode(s) for s in data.split(b"\0")] if data else []


def _refuse(root, problems):
    """Raises the one ValueError naming `problems` ({kind: [path text, ...]}) when there are any."""
    if not problems:
        return
    parts = []
    for kind, items in problems.items():
        shown = "; ".join(items[:SHOWN]) + ("; ..." if len(items) > SHOWN else "")
        parts.append(f"{len(items):,} {kind}: {shown}")
    raise ValueError(
        f"Image folder {root} cannot be read as <class>/<image> folders: " + ". ".join(parts) + ". "
        f"Images are files ending in {', '.join(IMAGE_EXTENSIONS)} (any letter case) inside one folder "
        "per class; hidden files (a leading '.', __MACOSX, Thumbs.db, desktop.ini) are skipped. Move or "
        "convert the files named (TIFF or HEIC to PNG or JPEG), or remove the links."
    )


def _entries(root, path, rel, seen, folders, problems):
    """The entries of folder `path` (relative path `rel`) a listing reads, sorted by name, the folder noted
    in `folders`; none where it was read already (a problem)."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino)
    if key in seen:
        problems["symbolic links to a folder already read (a loop, or one folder listed twice)"].append(
            f"{path} repeats {os.path.join(root, seen[key]) if seen[key] else root}"
        )
        return []
    seen[key] = rel
    folders.append((rel, st.st_dev, st.st_ino, st.st_mtime_ns))
    with os.scandir(path) as entries:
        return sorted((e for e in entries if not is_hidden(e.name)), key=lambda e: e.name)


def _walk(root, path, rel, seen, folders, images, problems):
    """Reads folder `path` (relative path `rel`) and its sub-folders into `images` (relative paths)."""
    for entry in _entries(root, path, rel, seen, folders, problems):
        entry_rel = f"{rel}/{entry.name}"
        if entry.is_dir():  # follows symbolic links
            _walk(root, entry.path, entry_rel, seen, folders, images, problems)
        elif entry.is_file():  # follows symbolic links
            if entry.name.lower().endswith(IMAGE_EXTENSIONS):
                images.append(entry_rel)
            else:
                problems["files that are not images this pipeline reads"].append(entry.path)
        elif entry.is_symlink():
            problems["broken symbolic links"].append(f"{entry.path} -> {os.readlink(entry.path)}")
        else:
            problems["entries that are neither files nor folders"].append(entry.path)


def list_split(root, classes=None):
    """The `Listing` of split folder `root` by the rules of the module docstring. `classes` fix the labels
    (the training split's, for a validation split); None: the sorted class folders of `root`, each of
    which must then hold an image.

    Raises:
        FileNotFoundError: `root` is missing or holds no images at all.
        ValueError: the oddities the module docstring refuses, or class folders not in `classes`.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(
            f"Image folder {root} not found; expected {root}/<class>/<image>.JPEG "
            "(pass --data_dir=<folder holding train/ and validation/>)."
        )
    problems, seen, folders, class_folders = collections.defaultdict(list), {}, [], []
    for entry in _entries(root, root, "", seen, folders, problems):
        if entry.is_dir():
            class_folders.append(entry)
        elif entry.is_file() or not entry.is_symlink():
            problems["files outside the class folders"].append(entry.path)
        else:
            problems["broken symbolic links"].append(f"{entry.path} -> {os.readlink(entry.path)}")
    found = [e.name for e in class_folders]
    names = list(classes) if classes is not None else found
    index = {c: i for i, c in enumerate(names)}
    for name in found:
        if name not in index:
            problems["class folders the training split lacks"].append(os.path.join(root, name))
    files, labels = [], []
    for entry in class_folders:
        images = []
        _walk(root, entry.path, entry.name, seen, folders, images, problems)
        if not images and classes is None:
            problems["class folders without images"].append(entry.path)
        images.sort()
        files += images
        labels += [index.get(entry.name, -1)] * len(images)
    _refuse(root, problems)
    if not files:
        raise FileNotFoundError(f"No images ({', '.join(IMAGE_EXTENSIONS)}) under {root}/<class>/.")
    labels = np.asarray(labels, np.int32)
    return Listing(root, tuple(files), labels, tuple(names), tuple(folders), classes is not None)


def listed(root, index_path=None, classes=None):
    """(`Listing` of `root`, reused): read from `index_path` when that index is valid (this
    `INDEX_VERSION`, the same folder and `classes`, `Listing.unchanged()`), else listed anew (`list_split`,
    whose errors it raises) and saved there atomically. An index cut short, empty, of another format or a
    folder, or one that cannot be written, costs a one-line warning and a new listing."""
    classes = tuple(classes) if classes is not None else None
    keep = bool(index_path)
    if index_path and os.path.isdir(index_path):
        keep = False  # never removed: a folder is no file of ours
        log.warning(
            f"the listing index {index_path} is a folder, not a listing index; {root} is listed again "
            "and its listing is not kept there"
        )
    elif index_path and os.path.exists(index_path):
        try:
            with open(index_path, "rb") as f:
                old = Listing.from_bytes(f.read())
        except (ValueError, OSError, KeyError, zipfile.BadZipFile, EOFError) as e:
            old = None  # cut short, empty or another format: listed again, and written anew
            log.warning(
                f"the listing index {index_path} is cut short, empty or not a listing index "
                f"({type(e).__name__}: {e}); {root} is listed again"
            )
        if (
            old is not None
            and old.root == root
            and old.given_classes == (classes is not None)
            and (classes is None or old.classes == classes)
            and old.unchanged()
        ):
            return old, True
    listing = list_split(root, classes)
    if keep:
        tmp = f"{index_path}.tmp{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(index_path) or ".", exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(listing.to_bytes())
            os.replace(tmp, index_path)
        except OSError as e:  # the index only saves work: the listing is good without it
            log.warning(
                f"could not keep the listing of {root} in {index_path} ({e}); the next start lists it again"
            )
            if os.path.isfile(tmp):
                os.remove(tmp)
    return listing, False
