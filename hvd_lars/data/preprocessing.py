"""ImageNet preprocessing as the reference implementations do it: pure TensorFlow functions of one image.

Two conventions, chosen by name (`PREPROCESSINGS`, the main program's `--preprocessing`):

- `"inception"` (the default; ResNet-50): training (Szegedy et al. 2015, sec. 6; the TensorFlow and Flax
  ResNet-50 references): a random crop of 8%-100% of the image area with aspect ratio in [3/4, 4/3],
  decoded straight out of the JPEG, resized to `image_size` squared, flipped left-right with probability
  1/2. Evaluation (He et al. 2016; Goyal et al. 2017): the short side resized to 256, the centre
  `image_size` squared cropped. Both end with per-channel mean/std normalisation.
- `"caffe"` / `"caffe_scaled"` (the AlexNets, as the paper's Caffe data layer fed them; Intel Caffe 1.0.7's
  `models/bvlc_alexnet/train_val.prototxt` and `alexnet_bn_64nodes/train_val2.prototxt`): the image
  resized to 256x256 (aspect ratio not kept), then for training a 227x227 window at a uniformly random
  offset in [0, 29] per axis and a mirror with probability 1/2, for evaluation the centre window (offset
  14); the per-channel means of Caffe's mean image are subtracted (`CAFFE_MEAN_RGB`; docs/design.md says
  why not the image), and `"caffe_scaled"` then multiplies by 1/256.

Every function takes encoded bytes (JPEG, or PNG/GIF/BMP: ImageNet has a PNG saved as `.JPEG`) and decodes
to RGB whatever the stored colour space. Randomness is stateless: a `seed` is an int64 tensor of shape (2,).
"""

import dataclasses
import functools

import tensorflow as tf

# Training crop: fraction of the image area and width/height ratio (Szegedy et al. 2015).
CROP_AREA_RANGE = (0.08, 1.0)
CROP_ASPECT_RATIO_RANGE = (3.0 / 4.0, 4.0 / 3.0)
# Tries before falling back to a centre crop (10 in the TensorFlow/Flax references).
CROP_MAX_ATTEMPTS = 10
# Evaluation: short side resized to EVAL_RESIZE for an EVAL_CROP crop; other crop sizes keep the ratio.
EVAL_RESIZE = 256
EVAL_CROP = 224
DEFAULT_IMAGE_SIZE = 224  # ResNet-50 (He et al. 2016)
ALEXNET_IMAGE_SIZE = 227  # AlexNet / AlexNet-BN (Krizhevsky et al. 2012; You et al. 2018)
# ImageNet training-set channel means and standard deviations on the 0-255 scale (the torchvision and
# Flax references' values, 0.485/0.456/0.406 and 0.229/0.224/0.225 times 255).
MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)
# Caffe: images stored at 256x256, 227x227 crops.
CAFFE_RESIZE = 256
CAFFE_CROP = ALEXNET_IMAGE_SIZE
# Channel means (0-255, R, G, B) of Caffe's ILSVRC-2012 mean image, i.e. of the training set resized to
# 256x256: the B, G, R averages 104.00698793, 116.66876762, 122.67891434 of `ilsvrc_2012_mean.npy`.
CAFFE_MEAN_RGB = (122.67891434, 116.66876762, 104.00698793)
# `scale: 0.00390625` of the released AlexNet-BN data layer (train_val2.prototxt), applied after the mean.
CAFFE_BN_SCALE = 1.0 / 256.0


def caffe_resize_size(image_size):
    """Side (pixels) of the square the Caffe pipeline resizes to: 256 for 227 (ratio 256/227 otherwise)."""
    return int(round(image_size * CAFFE_RESIZE / CAFFE_CROP))


def eval_resize_size(image_size):
    """Short side (pixels) before the evaluation centre crop: 256 for 224, 259 for 227 (ratio 256/224)."""
    return int(round(image_size * EVAL_RESIZE / EVAL_CROP))


def decode_rgb(data):
    """Decodes JPEG/PNG/GIF/BMP bytes (scalar string tensor) to uint8 (H, W, 3) RGB; when run, raises
    `tf.errors.InvalidArgumentError` for bytes that are no decodable image."""
    image = tf.cond(
        tf.io.is_jpeg(data),
        lambda: tf.io.decode_jpeg(data, channels=3),
        lambda: tf.io.decode_image(data, channels=3, expand_animations=False),
    )
    image.set_shape([None, None, 3])
    return image


def random_crop_window(height_width, seed):
    """An Inception-style crop window [y, x, h, w] (int32, shape (4,)) inside an image of `height_width`:
    area in CROP_AREA_RANGE, aspect ratio w/h in CROP_ASPECT_RATIO_RANGE; when CROP_MAX_ATTEMPTS samples
    all fail (tiny or very elongated images), the evaluation centre crop."""
    height_width = tf.cast(height_width, tf.int32)
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.concat([height_width, [3]], axis=0),
        bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]),
        seed=seed,
        # The box is the whole image, so the fraction of it covered is the crop's area fraction.
        min_object_covered=CROP_AREA_RANGE[0],
        aspect_ratio_range=CROP_ASPECT_RATIO_RANGE,
        area_range=CROP_AREA_RANGE,
        max_attempts=CROP_MAX_ATTEMPTS,
        use_image_if_no_bounding_boxes=True,
    )
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    # The op returns the whole image when every attempt failed; the references then take the centred
    # square of side EVAL_CROP / EVAL_RESIZE of the short side.
    side = tf.cast(tf.cast(tf.reduce_min(height_width), tf.float32) * (EVAL_CROP / EVAL_RESIZE), tf.int32)
    side = tf.maximum(side, 1)
    centre = tf.stack([(height_width[0] - side + 1) // 2, (height_width[1] - side + 1) // 2, side, side])
    failed = tf.reduce_all(tf.equal(size[:2], height_width))
    return tf.cond(failed, lambda: centre, lambda: window)


def decode_and_random_crop(data, seed):
    """Decodes only the random crop window of `data`: uint8 (h, w, 3). JPEGs are cropped inside the decoder
    (`decode_and_crop_jpeg`); other formats are decoded whole and sliced, giving the same pixels."""

    def jpeg():
        window = random_crop_window(tf.image.extract_jpeg_shape(data)[:2], seed)
        return tf.image.decode_and_crop_jpeg(data, window, channels=3)

    def other():
        image = tf.io.decode_image(data, channels=3, expand_animations=False)
        window = random_crop_window(tf.shape(image)[:2], seed)
        return tf.slice(image, [window[0], window[1], 0], [window[2], window[3], 3])

    crop = tf.cond(tf.io.is_jpeg(data), jpeg, other)
    crop.set_shape([None, None, 3])
    return crop


def normalize(image):
    """(image - MEAN_RGB) / STDDEV_RGB as float32, image on the 0-255 scale, shape (..., 3)."""
    image = tf.cast(image, tf.float32)
    return (image - tf.constant(MEAN_RGB, tf.float32)) / tf.constant(STDDEV_RGB, tf.float32)


def preprocess_train(data, seed, image_size=DEFAULT_IMAGE_SIZE):
    """Training view of encoded image `data`: float32 (image_size, image_size, 3), normalised; `seed`:
    int64 (2,), split into the crop's and the flip's."""
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
    crop = decode_and_random_crop(data, crop_seed)
    image = tf.image.resize(crop, [image_size, image_size], method="bilinear")
    image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    image = normalize(image)
    image.set_shape([image_size, image_size, 3])
    return image


def resize_short_side(image, short_side):
    """Bilinear resize keeping the aspect ratio so that min(H, W) == short_side; float32 (H', W', C)."""
    height_width = tf.cast(tf.shape(image)[:2], tf.float32)
    scale = tf.cast(short_side, tf.float32) / tf.reduce_min(height_width)
    new_size = tf.maximum(tf.cast(tf.round(height_width * scale), tf.int32), short_side)
    return tf.image.resize(image, new_size, method="bilinear")


def preprocess_eval(data, image_size=DEFAULT_IMAGE_SIZE):
    """Evaluation view of encoded image `data`: short side to `eval_resize_size(image_size)`, the centre
    crop (offsets (H - size) // 2, (W - size) // 2); float32 (image_size, image_size, 3), normalised."""
    image = resize_short_side(decode_rgb(data), eval_resize_size(image_size))
    y, x = tf.unstack((tf.shape(image)[:2] - image_size) // 2)
    image = normalize(image[y : y + image_size, x : x + image_size])
    image.set_shape([image_size, image_size, 3])
    return image


def caffe_crop_offsets(resized_side, image_size, seed=None):
    """Top-left corner [y, x] (int32, shape (2,)) of Caffe's `image_size` square crop in a square image:
    with a `seed`, each uniform in [0, resized_side - image_size] (Caffe's `DataTransformer` draws
    `Rand(side - crop + 1)`); without, the centre (resized_side - image_size) // 2 (14 for 227 in 256)."""
    if seed is None:
        return tf.fill([2], tf.constant((resized_side - image_size) // 2, tf.int32))
    return tf.random.stateless_uniform(
        [2], seed, minval=0, maxval=resized_side - image_size + 1, dtype=tf.int32
    )


def preprocess_train_caffe(data, seed, image_size=ALEXNET_IMAGE_SIZE, scale=1.0):
    """Caffe training view of `data`: float32 (image_size, image_size, 3). Resized to 256x256 (for 227;
    aspect ratio not kept), a random square crop (`caffe_crop_offsets`), mirrored with probability 1/2, the
    channel means subtracted, times `scale`; `seed`: int64 (2,), split into the crop's and the mirror's."""
    return _caffe_view(data, image_size, scale, seed)


def preprocess_eval_caffe(data, image_size=ALEXNET_IMAGE_SIZE, scale=1.0):
    """Caffe evaluation view: as `preprocess_train_caffe` with the centre crop and no mirror."""
    return _caffe_view(data, image_size, scale)


def _caffe_view(data, image_size, scale, seed=None):
    side = caffe_resize_size(image_size)
    image = tf.image.resize(decode_rgb(data), [side, side], method="bilinear")
    crop_seed = flip_seed = None
    if seed is not None:
        crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
    y, x = tf.unstack(caffe_crop_offsets(side, image_size, crop_seed))
    image = image[y : y + image_size, x : x + image_size]
    if seed is not None:
        image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    image = (image - tf.constant(CAFFE_MEAN_RGB, tf.float32)) * scale
    image.set_shape([image_size, image_size, 3])
    return image


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """A pair of pure functions: `train(data, seed, image_size)` and `eval(data, image_size)`, each
    returning float32 (image_size, image_size, 3)."""

    train: object
    eval: object


PREPROCESSINGS = {
    "inception": Preprocessing(preprocess_train, preprocess_eval),
    "caffe": Preprocessing(preprocess_train_caffe, preprocess_eval_caffe),
    "caffe_scaled": Preprocessing(
        functools.partial(preprocess_train_caffe, scale=CAFFE_BN_SCALE),
        functools.partial(preprocess_eval_caffe, scale=CAFFE_BN_SCALE),
    ),
}
DEFAULT_PREPROCESSING = "inception"


def get_preprocessing(name):
    """`PREPROCESSINGS[name]` (None or "": "inception"); ValueError for an unknown name, listing the valid."""
    name = name or DEFAULT_PREPROCESSING
    if name not in PREPROCESSINGS:
        raise ValueError(f"Unknown preprocessing {name!r}; valid names: {', '.join(sorted(PREPROCESSINGS))}.")
    return PREPROCESSINGS[name]
