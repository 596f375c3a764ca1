"""ImageNet preprocessing: crop statistics, exact crops, eval geometry, normalisation."""

import numpy as np
import pytest
import tensorflow as tf

from hvd_lars.data import preprocessing as pp
from tests.support.data_fixtures import CMYK, PNG, encode


def _seed(i):
    return tf.constant([7, i], tf.int64)


def _gradient_image(height, width):
    # Distinct values everywhere (not symmetric), so a crop or a flip shows in the pixels.
    y, x = np.mgrid[:height, :width]
    return np.stack([(x * 255) // (width - 1), (y * 255) // (height - 1), (x + y) % 256], -1).astype(np.uint8)


@pytest.mark.unit
def test_normalize_hand_values():
    pixels = tf.constant([[123.675, 116.28, 103.53], [255, 255, 255], [0, 0, 0]])
    want = [[0, 0, 0], [131.325 / 58.395, 138.72 / 57.12, 151.47 / 57.375], [-2.117904, -2.035714, -1.804444]]
    np.testing.assert_allclose(pp.normalize(pixels).numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.unit
def test_random_crop_windows_stay_in_range_repeat_and_fall_back_to_the_centre():
    height, width = 300, 400
    windows = np.array([pp.random_crop_window([height, width], _seed(i)).numpy() for i in range(200)])
    y, x, h, w = windows.T
    assert (y >= 0).all() and (x >= 0).all() and (y + h <= height).all() and (x + w <= width).all()
    area = h * w / (height * width)
    assert area.min() >= 0.08 - 0.01 and area.max() <= 1.0
    assert (w / h).min() >= 0.75 - 0.02 and (w / h).max() <= 4 / 3 + 0.02
    assert len({tuple(v) for v in windows}) > 190  # 200 seeds, (almost) all different windows
    # The whole range is used: small crops and crops of nearly the whole image both occur.
    assert (area < 0.15).sum() > 10 and (area > 0.8).sum() > 5
    # A 1000x10 strip: a crop with w/h >= 3/4 has at most 10 x 13 pixels, 1.3% < 8% of the area, so the
    # centre crop: side int(10 * 224/256) = 8, y = (1000 - 8 + 1) // 2, x = (10 - 8 + 1) // 2.
    np.testing.assert_array_equal(pp.random_crop_window([1000, 10], _seed(0)).numpy(), [496, 1, 8, 8])


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["rgb", PNG, CMYK])
def test_decode_and_random_crop_equals_decode_then_slice(kind):
    data = tf.constant(encode(_gradient_image(120, 160), kind))
    for i in range(5):
        y, x, h, w = pp.random_crop_window([120, 160], _seed(i)).numpy()
        crop = pp.decode_and_random_crop(data, _seed(i)).numpy()
        whole = pp.decode_rgb(data).numpy()
        assert crop.shape == (h, w, 3)
        difference = np.abs(crop.astype(np.int32) - whole[y : y + h, x : x + w])
        if kind == PNG:
            assert difference.max() == 0
        else:
            # libjpeg upsamples chroma differently at the crop's edge: a level or two on edge pixels only.
            assert difference.max() <= 3 and difference.mean() < 0.05


@pytest.mark.unit
@pytest.mark.parametrize("size, short_side, resized", [(224, 256, (256, 341)), (227, 259, (259, 345))])
def test_eval_resize_keeps_aspect_and_crops_the_centre(size, short_side, resized):
    assert pp.eval_resize_size(size) == short_side  # the 224 / 256 ratio
    assert tuple(pp.resize_short_side(tf.zeros([300, 400, 3], tf.uint8), short_side).shape[:2]) == resized
    # Short side already `short_side`: no resampling, so the view is exactly the centre window.
    image = np.random.default_rng(0).integers(0, 256, size=(short_side, 2 * short_side, 3), dtype=np.uint8)
    y, x = (short_side - size) // 2, (2 * short_side - size) // 2
    want = (image[y : y + size, x : x + size].astype(np.float32) - pp.MEAN_RGB) / pp.STDDEV_RGB
    np.testing.assert_allclose(pp.preprocess_eval(tf.constant(encode(image, PNG)), size), want, atol=1e-5)


@pytest.mark.unit
def test_train_view_shape_range_and_flip_rate():
    data = tf.constant(encode(_gradient_image(64, 64), PNG))
    flipped = 0
    for i in range(100):
        out = pp.preprocess_train(data, _seed(i), 32).numpy()
        assert out.shape == (32, 32, 3) and out.dtype == np.float32
        assert out.min() >= -2.12 and out.max() <= 2.65  # normalised 0..255
        red = out[..., 0].mean(axis=0)  # red grows with x in the source: the flip reverses it
        flipped += red[0] > red[-1]
    assert 30 <= flipped <= 70
    again = pp.preprocess_train(data, _seed(5), 32).numpy()
    np.testing.assert_array_equal(again, pp.preprocess_train(data, _seed(5), 32).numpy())


@pytest.mark.unit
def test_corrupt_bytes_and_unknown_views_are_refused():
    with pytest.raises(tf.errors.InvalidArgumentError):
        pp.decode_rgb(tf.constant(b"not an image at all"))
    with pytest.raises(ValueError, match="'vgg'; valid names: caffe, caffe_scaled, inception"):
        pp.get_preprocessing("vgg")


@pytest.mark.unit
def test_caffe_crop_windows_and_square_resize():
    # Training: y and x uniform over the 30 offsets 0..29 of a 227 window in 256 (Caffe's Rand(256-227+1)),
    # independent; evaluation: the centre, (256 - 227) // 2 = 14.
    offsets = np.array([pp.caffe_crop_offsets(256, 227, _seed(i)).numpy() for i in range(900)])
    assert set(offsets[:, 0]) == set(range(30)) and set(offsets[:, 1]) == set(range(30))
    counts = np.bincount(offsets[:, 0], minlength=30)
    assert counts.min() >= 10 and counts.max() <= 55  # 30 expected per offset
    assert abs(np.corrcoef(offsets.T)[0, 1]) < 0.1
    # The image is resized to a 256 square, not keeping the aspect ratio.
    image = _gradient_image(300, 400)
    data = tf.constant(encode(image, PNG))
    resized = tf.image.resize(image, [256, 256], method="bilinear").numpy()
    out = pp.preprocess_eval_caffe(data, 227).numpy()
    np.testing.assert_allclose(out, resized[14:241, 14:241] - pp.CAFFE_MEAN_RGB, atol=1e-3)
    # Smaller crops keep the 256/227 ratio: 36 for 32.
    assert pp.caffe_resize_size(32) == 36
    assert pp.preprocess_train_caffe(data, _seed(0), 32).shape == (32, 32, 3)


@pytest.mark.unit
@pytest.mark.parametrize("name, scale", [("caffe", 1.0), ("caffe_scaled", 1 / 256)])
def test_caffe_views_are_exact_crops_of_a_256_image(name, scale):
    # Caffe's ImageNet mean (BGR, ilsvrc_2012_mean.npy averaged) and the AlexNet-BN scale 1 / 256.
    np.testing.assert_allclose(pp.CAFFE_MEAN_RGB[::-1], [104.00698793, 116.66876762, 122.67891434])
    # A lossless 256x256 image: the resize is the identity, so each view is exactly a window of it.
    image = np.random.default_rng(1).integers(0, 256, size=(256, 256, 3), dtype=np.uint8)
    data = tf.constant(encode(image, PNG))
    views = pp.get_preprocessing(name)

    def normalized(window):
        return (window.astype(np.float64) - pp.CAFFE_MEAN_RGB) * scale

    np.testing.assert_allclose(views.eval(data, 227).numpy(), normalized(image[14:241, 14:241]), atol=1e-4)
    mirrored = 0
    for i in range(20):
        crop_seed, _ = tf.unstack(tf.random.experimental.stateless_split(_seed(i), num=2))
        y, x = pp.caffe_crop_offsets(256, 227, crop_seed).numpy()
        window = normalized(image[y : y + 227, x : x + 227])
        out = views.train(data, _seed(i), 227).numpy()
        assert out.shape == (227, 227, 3) and out.dtype == np.float32
        flipped = np.abs(out - window[:, ::-1]).max() < 1e-4
        assert flipped or np.abs(out - window).max() < 1e-4
        mirrored += flipped
    assert 3 <= mirrored <= 17
