"""Image folders as users have them: every oddity handled or refused naming the path; the index file."""

import os

import numpy as np
import pytest
from PIL import Image

from hvd_lars.data import InputRequest, get_input, listing
from tests.support.data_fixtures import encode, source_images

PICTURE = source_images(1)[0]  # 28x28 RGB
JPEG = encode(PICTURE)


def _write(root, files):
    """Creates `files` (paths relative to root; a value is the bytes, a "->target" string a link)."""
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str) and content.startswith("->"):
            path.symlink_to(content[2:])
        elif content is None:
            path.mkdir(exist_ok=True)
        else:
            path.write_bytes(JPEG if content is ... else content)


@pytest.mark.unit
def test_what_a_listing_reads_hidden_entries_links_sub_folders_odd_names_image_formats_classes(tmp_path):
    odd = os.fsdecode(b"caf\xe9 latin-1.JPEG")  # not UTF-8: kept as the file system's bytes
    # Hidden: a notebook's checkpoints folder beside the classes, macOS ._ files and Windows' files.
    _write(tmp_path, {
        "train/cat/cat_0.JPEG": ..., "train/cat/._cat_0.JPEG": b"\x00\x05\x16\x07 AppleDouble",
        "train/cat/.DS_Store": b"\x00\x00\x00\x01Bud1", "train/cat/.hidden/cat_9.JPEG": ...,
        "train/cat/2024/a b.JPEG": ..., "train/cat/linked.JPEG": "->../../elsewhere/one.JPEG",
        "train/dog/dog_0.jpg": ..., "train/dog/Thumbs.db": b"\xd0\xcf\x11\xe0", f"train/dog/{odd}": ...,
        "train/dog/desktop.ini": b"[.ShellClassInfo]", "train/dog/Ärger ü.jpg": ...,
        "train/.ipynb_checkpoints/cat_0-checkpoint.JPEG": ..., "train/__MACOSX/cat/._cat_0.JPEG": b"\x00\x05",
        "train/.DS_Store": b"Bud1", "train/bird": "->../elsewhere/birds", "elsewhere/birds/b0.JPEG": ...,
        "elsewhere/birds/b1.png": encode(PICTURE, "png"), "elsewhere/one.JPEG": ...,
        "validation/bird": None, "validation/.ipynb_checkpoints/x.JPEG": ...,
    })  # fmt: skip
    # Validation: each image format, its extension in any letter case; no bird (its folder is empty).
    formats = {"cat/a.JPEG": "JPEG", "cat/b.jpg": "JPEG", "cat/c.Jpg": "JPEG", "cat/d.PNG": "PNG"}
    formats.update({"dog/e.gif": "GIF", "dog/f.BMP": "BMP", "dog/g.webp": "WEBP", "dog/h.JPE": "JPEG"})
    for name, kind in formats.items():
        (tmp_path / "validation" / name).parent.mkdir(exist_ok=True)
        Image.fromarray(PICTURE).save(tmp_path / "validation" / name, kind, lossless=True)  # WebP's
    found = listing.list_split(str(tmp_path / "train"))
    assert found.classes == ("bird", "cat", "dog")
    assert found.files == ("bird/b0.JPEG", "bird/b1.png", "cat/2024/a b.JPEG", "cat/cat_0.JPEG",
        "cat/linked.JPEG", "dog/caf\udce9 latin-1.JPEG", "dog/dog_0.jpg", "dog/Ärger ü.jpg")  # fmt: skip
    assert found.labels.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert all(os.path.isfile(p) for p in found.paths())
    assert listing.list_split(str(tmp_path / "validation"), found.classes).files == tuple(formats)
    request = InputRequest(per_rank_batch=1, rank=0, world_size=1, seed=0, data_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"validation has no images of 1 of the 3 training classes \(bird\)"):
        data = get_input("image_folder", request, image_size=28)
    assert (data.num_classes, data.num_train_examples, data.num_eval_examples) == (3, 8, 8)
    labels = [int(y[0]) for _, y in data.train.take(16)]  # two epochs: every file opened and decoded
    assert sorted(labels[:8]) == sorted(labels[8:]) == [0, 0, 1, 1, 1, 2, 2, 2]
    evaluated = list(data.eval)
    assert [int(y[0]) for _, y in evaluated] == [1, 1, 1, 1, 2, 2, 2, 2]  # training's labels
    # The lossless formats decode to the same pixels (one view of each, compared with the PNG's).
    images = [x[0].numpy() for x, _ in evaluated]
    for i in (5, 6):  # BMP and WebP
        np.testing.assert_allclose(images[i], images[3], atol=0.05)
    _write(tmp_path, {"validation/fox/e.JPEG": ...})  # a class training lacks: refused
    with pytest.raises(
        ValueError, match=f"1 class folders the training split lacks: {tmp_path}/validation/fox"
    ):
        listing.list_split(str(tmp_path / "validation"), found.classes)


LOOP = "symbolic links to a folder already read (a loop, or one folder listed twice)"
# Each layout of a split folder that is refused: the ValueError names every path (`{r}`: the split folder).
REFUSED = {
    "not images": (
        {"cat/a.JPEG": ..., "cat/scan.tif": b"II*\x00", "cat/photo.HEIC": b"ftypheic", "dog/b.jpg": ...,
         "dog/labels.csv": b"file,label\n", "dog/old/notes.txt": b"x"},
        ["4 files that are not images this pipeline reads", "{r}/cat/scan.tif", "{r}/cat/photo.HEIC",
         "{r}/dog/labels.csv", "{r}/dog/old/notes.txt", "TIFF or HEIC to PNG or JPEG", ".jpeg, .jpg"],
    ),
    "unsorted images": (
        {"ILSVRC2012_val_00000001.JPEG": ..., "n01440764/a.JPEG": ...},
        ["1 files outside the class folders: {r}/ILSVRC2012_val_00000001.JPEG. "],
    ),
    "a loop": ({"cat/a.JPEG": ..., "cat/again": "->.."}, [f"1 {LOOP}: {{r}}/cat/again repeats {{r}}. "]),
    "a folder twice": ({"cat/a.JPEG": ..., "kitten": "->cat"}, [f"{LOOP}: {{r}}/kitten repeats {{r}}/cat. "]),
    "broken links": (
        {"cat/a.JPEG": ..., "cat/gone.JPEG": "->/nonexistent/gone.JPEG", "dog": "->/nonexistent"},
        ["2 broken symbolic links", "{r}/cat/gone.JPEG -> /nonexistent/gone.JPEG", "{r}/dog -> /nonexistent"],
    ),
    "empty classes": (
        {"cat/a.JPEG": ..., "dog": None, "fox/.DS_Store": b"Bud1", "owl/empty": None},
        ["3 class folders without images: {r}/dog; {r}/fox; {r}/owl. "],
    ),
}  # fmt: skip


@pytest.mark.unit
@pytest.mark.parametrize("layout", REFUSED)
def test_refused_layouts_name_every_path(tmp_path, layout):
    files, fragments = REFUSED[layout]
    _write(tmp_path, files)
    with pytest.raises(ValueError) as info:
        listing.list_split(str(tmp_path))
    for fragment in fragments:
        assert fragment.format(r=tmp_path) in str(info.value)


@pytest.mark.unit
def test_index_is_reused_until_a_folder_changes(tmp_path):
    _write(tmp_path, {"train/cat/a.JPEG": ..., "train/dog/b.JPEG": ..., "elsewhere/owl/c.JPEG": ...})
    root, index = str(tmp_path / "train"), str(tmp_path / "run" / "train.index.npz")
    first, reused = listing.listed(root, index)
    assert not reused and os.path.exists(index)
    again, reused = listing.listed(root, index)
    assert reused and again.files == first.files and again.classes == first.classes
    np.testing.assert_array_equal(again.labels, first.labels)
    changes = [
        lambda: _write(tmp_path, {"train/cat/new.JPEG": ...}),  # a file added
        lambda: os.remove(f"{root}/cat/new.JPEG"),  # removed
        lambda: _write(tmp_path, {"train/owl": "->../elsewhere/owl"}),  # a class folder linked in
        lambda: _write(tmp_path, {"elsewhere/owl/d.JPEG": ...}),  # a file added behind that link
    ]
    for change in changes:
        change()
        listed, reused = listing.listed(root, index)
        assert not reused, change
        assert listed.files == listing.list_split(root).files
        assert listing.listed(root, index)[1]
    assert listed.files == ("cat/a.JPEG", "dog/b.JPEG", "owl/c.JPEG", "owl/d.JPEG")
    # Another folder or another class list is listed afresh, and a damaged index is not trusted.
    assert not listing.listed(str(tmp_path / "elsewhere"), index)[1]
    assert not listing.listed(root, index)[1]
    assert not listing.listed(root, index, classes=("cat", "dog", "owl", "yak"))[1]
    assert listing.listed(root, index, classes=("cat", "dog", "owl", "yak"))[1]
    assert not listing.listed(root, index)[1]


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["cut short", "empty", "another format", "a folder"])
def test_a_damaged_index_or_a_folder_in_its_place_is_named_and_listed_again(tmp_path, caplog, kind):
    _write(tmp_path, {"train/cat/a.JPEG": ..., "train/dog/b.JPEG": ...})
    root, index = str(tmp_path / "train"), tmp_path / "run" / "train.index.npz"
    if kind == "a folder":
        (index / "kept").mkdir(parents=True)  # where the index file belongs, with something in it
    else:
        listing.listed(root, str(index))
        data = index.read_bytes()
        index.write_bytes(
            {"cut short": data[: len(data) // 2], "empty": b"", "another format": b"a,b\n0\n"}[kind]
        )
    again, reused = listing.listed(root, str(index))
    assert not reused and again.files == ("cat/a.JPEG", "dog/b.JPEG")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if kind == "a folder":
        assert warned == [f"the listing index {index} is a folder, not a listing index; {root} is listed "
                          "again and its listing is not kept there"]  # fmt: skip
        assert os.listdir(index) == ["kept"] and os.listdir(index.parent) == ["train.index.npz"]
    else:
        assert len(warned) == 1 and warned[0].startswith(f"the listing index {index} is cut short")
        assert listing.listed(root, str(index))[1]  # written anew, and reused
