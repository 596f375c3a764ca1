"""Test-side hooks that record what an input pipeline reads and decodes (the resume tests).

`ReadCounter(monkeypatch)` patches the three places the pipelines touch data: `image_folder._read_file`
(every image file opened), `records._read_records` (every TFRecord record read, skipped ones included)
and the training views of `encoded_images.get_preprocessing` (every image decoded, by its element index in the
rank's stream). Pipelines built afterwards report into `files`, `records` and `decoded`.
"""

import dataclasses
import threading
import time

import tensorflow as tf

from hvd_lars.data import encoded_images, image_folder, records


class ReadCounter:
    def __init__(self, monkeypatch):
        self.files, self.records, self.decoded = [], [], []
        self._lock = threading.Lock()
        read_file, read_records = image_folder._read_file, records._read_records
        get_preprocessing = encoded_images.get_preprocessing

        def note(store, value):
            def record(v):
                value = v.numpy()  # bytes for a string, a NumPy scalar otherwise
                with self._lock:
                    store.append(value.item() if hasattr(value, "item") else value)
                return v

            return tf.py_function(record, [value], value.dtype)

        def counted_read_file(path):
            return read_file(note(self.files, path))

        def counted_read_records(filename, skip, take):
            def keep(record):
                with tf.control_dependencies([note(self.records, tf.strings.length(record))]):
                    return tf.identity(record)

            # Every record read, also those the block skips past.
            return read_records(filename, 0, skip + take).map(keep).skip(skip)

        def counted_preprocessing(name):
            views = get_preprocessing(name)

            def train(data, seed, size):
                with tf.control_dependencies([note(self.decoded, seed[1])]):
                    return views.train(data, seed, size)

            return dataclasses.replace(views, train=train)

        monkeypatch.setattr(image_folder, "_read_file", counted_read_file)
        monkeypatch.setattr(records, "_read_records", counted_read_records)
        monkeypatch.setattr(encoded_images, "get_preprocessing", counted_preprocessing)

    def reset(self):
        with self._lock:
            for store in (self.files, self.records, self.decoded):
                store.clear()

    def settled(self, timeout=30.0):
        """Waits until the background read-ahead of the pipelines stops adding, then returns
        (files, records, decoded) counts."""
        last, deadline = None, time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                now = (len(self.files), len(self.records), len(self.decoded))
            if now == last:
                return now
            last = now
            time.sleep(0.3)
        return last
