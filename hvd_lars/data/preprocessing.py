"""ImageNet preprocessing as the reference implementations do it: pure TensorFlow functions of one image.

Training (Szegedy et al., "Going deeper with convolutions", CVPR 2015, sec. 6; the TensorFlow and Flax
ResNet-50 references): a random crop covering 8%-100% of the image area with aspect ratio in [3/4, 4/3],
decoded straight out of the JPEG (only the crop's blocks are decompressed), resized to `image_size`
squared, flipped left-right with probability 1/2. Evaluation (He et al. 2016; Goyal et al. 2017): the short
side resized to 256, the centre `image_size` squared cropped. Both end with per-channel mean/std
normalisation. AlexNet (Krizhevsky et al. 2012) takes 227x227 crops; ResNet-50 224x224.

Every function takes encoded bytes (JPEG, or PNG/GIF/BMP: ImageNet has a PNG saved as `.JPEG`) and decodes
to RGB whatever the stored colour space (CMYK and greyscale JPEGs are in ImageNet's training set).
Randomness is stateless: a `seed` is an int64 tensor of shape (2,), so the same seed gives the same crop.
"""

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


def eval_resize_size(image_size):
    """Short side (pixels) before the evaluation centre crop: 256 for 224, 259 for 227 (ratio 256/224)."""
    return int(round(image_size * EVAL_RESIZE / EVAL_CROP))


def decode_rgb(data):
    """Decodes JPEG/PNG/GIF/BMP bytes (scalar string tensor) to uint8 (H, W, 3) RGB.

    Raises (when run): `tf.errors.InvalidArgumentError` for bytes that are no decodable image.
    """
    image = tf.cond(
        tf.io.is_jpeg(data),
        lambda: tf.io.decode_jpeg(data, channels=3),
        lambda: tf.io.decode_image(data, channels=3, expand_animations=False),
    )
    image.set_shape([None, None, 3])
    return image


def random_crop_window(height_width, seed):
    """An Inception-style crop window [y, x, h, w] (int32, shape (4,)) inside an image of `height_width`.

    Area in CROP_AREA_RANGE of the image, aspect ratio w/h in CROP_ASPECT_RATIO_RANGE; when
    CROP_MAX_ATTEMPTS samples all fail (tiny or very elongated images), the evaluation centre crop.
    """
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
    # The op returns the whole image when every attempt failed; the references then centre-crop.
    failed = tf.reduce_all(tf.equal(size[:2], height_width))
    return tf.cond(failed, lambda: center_crop_window(height_width), lambda: window)


def center_crop_window(height_width):
    """The centred square [y, x, h, w] (int32) of side EVAL_CROP / EVAL_RESIZE of the short side."""
    height_width = tf.cast(height_width, tf.int32)
    side = tf.cast(tf.cast(tf.reduce_min(height_width), tf.float32) * (EVAL_CROP / EVAL_RESIZE), tf.int32)
    side = tf.maximum(side, 1)
    y = (height_width[0] - side + 1) // 2
    x = (height_width[1] - side + 1) // 2
    return tf.stack([y, x, side, side])


def decode_and_random_crop(data, seed):
    """Decodes only the random crop window of `data`: uint8 (h, w, 3).

    JPEGs are cropped inside the decoder (`decode_and_crop_jpeg`, decode and crop in one step); other
    formats are decoded whole and sliced, giving the same pixels.
    """

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
    """Training view of encoded image `data`: float32 (image_size, image_size, 3), normalised.

    `seed`: int64 (2,); the crop and the flip use independent streams derived from it.
    """
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


def center_crop(image, size):
    """The centred size x size crop of (H, W, C) `image` (H, W >= size); offsets (H - size) // 2 etc."""
    height_width = tf.shape(image)[:2]
    y = (height_width[0] - size) // 2
    x = (height_width[1] - size) // 2
    return image[y : y + size, x : x + size]


def preprocess_eval(data, image_size=DEFAULT_IMAGE_SIZE):
    """Evaluation view of encoded image `data`: short side to `eval_resize_size(image_size)`, centre crop.

    Returns float32 (image_size, image_size, 3), normalised.
    """
    image = resize_short_side(decode_rgb(data), eval_resize_size(image_size))
    image = normalize(center_crop(image, image_size))
    image.set_shape([image_size, image_size, 3])
    return image
