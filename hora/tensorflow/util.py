"""Small helpers Horovod's TensorFlow tests import from ``horovod.tensorflow.util``."""

from __future__ import annotations

import tensorflow as tf


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not while building a graph)."""
    return tf.executing_eagerly()


executing_eagerly = _executing_eagerly
