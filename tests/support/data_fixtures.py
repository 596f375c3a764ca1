"""Small real-format image fixtures made from Fashion-MNIST test images: `make_image_folder` (with ImageNet's
oddities: CMYK and greyscale JPEGs, a PNG named .JPEG, a corrupt file on request) and `make_ilsvrc_tars`
(the smallest ILSVRC-2012 tar pair tensorflow-datasets' `imagenet2012` builder accepts)."""

import io
import os
import pathlib
import tarfile

import numpy as np
from PIL import Image

from hvd_lars.data import fashion_mnist_files

# Kinds of file written, by position in each class folder; everything else is an RGB JPEG.
CMYK, GREY, PNG = "cmyk", "grey", "png"


def source_images(count, offset=0):
    """`count` Fashion-MNIST test images as uint8 (count, 28, 28, 3) RGB (grey replicated)."""
    images, _ = fashion_mnist_files.load("test")
    return np.repeat(images[offset : offset + count], 3, axis=-1)


def encode(image, kind="rgb"):
    """Encoded bytes of uint8 (H, W, 3) `image`: JPEG (quality 95) in RGB, CMYK or greyscale, or PNG."""
    out, picture = io.BytesIO(), Image.fromarray(image)
    if kind == PNG:
        picture.save(out, "PNG")
    else:
        picture.convert({CMYK: "CMYK", GREY: "L"}.get(kind, "RGB")).save(out, "JPEG", quality=95)
    return out.getvalue()


def make_image_folder(root, train_counts, eval_counts, odd=None, corrupt=None):
    """Writes `train_counts` / `eval_counts` images per class (folder `n{c:08d}`) of the kinds `odd`
    ({(split, class, position): kind}; default two CMYK, a grey and a PNG in train, one of each in
    validation), and a garbage `broken.JPEG` in the (split, class) `corrupt`; returns
    {split: [(path, class index, kind, source image)]}."""
    if odd is None:
        odd = {("train", 0, 0): CMYK, ("train", 1, 0): CMYK, ("train", 2, 0): GREY, ("train", 3, 0): PNG}
        odd.update({("validation", 0, 0): CMYK, ("validation", 1, 0): GREY, ("validation", 2, 0): PNG})
    written, images = {}, iter(source_images(sum(train_counts) + sum(eval_counts)))
    for split, counts in (("train", train_counts), ("validation", eval_counts)):
        written[split] = []
        for c, count in enumerate(counts):
            folder = os.path.join(root, split, f"n{c:08d}")
            os.makedirs(folder, exist_ok=True)
            for k, image in zip(range(count), images):
                kind, path = odd.get((split, c, k), "rgb"), os.path.join(folder, f"n{c:08d}_{k}.JPEG")
                pathlib.Path(path).write_bytes(encode(image, kind))
                written[split].append((path, c, kind, image))
            if corrupt == (split, c):
                pathlib.Path(folder, "broken.JPEG").write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG " * 8)
                written[split].append((os.path.join(folder, "broken.JPEG"), c, "corrupt", None))
    return written


def _add(tar, name, data=None):
    info = tarfile.TarInfo(name)
    if data is None:
        info.type = tarfile.DIRTYPE
    else:
        info.size = len(data)
    tar.addfile(info, None if data is None else io.BytesIO(data))


def make_ilsvrc_tars(manual_dir, synsets, per_class, num_val, cmyk_name=None, png_name=None, val_names=None):
    """Writes the two ILSVRC-2012 tars; returns (train file names by synset, validation file names).
    `cmyk_name` / `png_name`: extra training files written as CMYK JPEG / PNG into their synset's tar;
    `val_names`: the validation entries instead of `ILSVRC2012_val_<8 digits>.JPEG` (".../" is a folder)."""
    os.makedirs(manual_dir, exist_ok=True)
    images = iter(source_images(len(synsets) * (per_class + 2)))
    train = {}
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_train.tar"), "w") as outer:
        for synset in synsets:
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as inner:
                names = [f"{synset}_{k}.JPEG" for k in range(per_class)]
                kinds = ["rgb"] * per_class
                for extra, kind in ((cmyk_name, CMYK), (png_name, PNG)):
                    if extra and extra.startswith(synset + "_"):
                        names.append(extra)
                        kinds.append(kind)
                for name, kind in zip(names, kinds):
                    _add(inner, name, encode(next(images), kind))
            _add(outer, f"{synset}.tar", buffer.getvalue())
            train[synset] = names
    if val_names is None:
        val_names = [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, num_val + 1)]
    images = iter(source_images(len(val_names), offset=len(synsets) * (per_class + 2)))
    with tarfile.open(os.path.join(manual_dir, "ILSVRC2012_img_val.tar"), "w") as tar:
        for name in val_names:
            _add(tar, name.rstrip("/"), None if name.endswith("/") else encode(next(images)))
    return train, val_names
