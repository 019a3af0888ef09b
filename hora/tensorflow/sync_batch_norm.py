"""Batch normalisation whose statistics cover every rank's batch (Horovod's ``SyncBatchNormalization``)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hora.core.ops import ReduceOp
from hora.core.runtime import global_process_set
from hora.tensorflow import mpi_ops


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """``tf.keras.layers.BatchNormalization`` with mean and variance computed over all ranks in training.

    The per-channel sums, sums of squares and counts travel in one allreduce,
    which is differentiable, so the gradient also flows through the global
    statistics.  Inference uses the moving averages, as the base layer does.
    """

    def __init__(self, *args: Any, process_set=global_process_set, **kwargs: Any) -> None:
        kwargs.pop("fused", None)
        super().__init__(*args, **kwargs)
        self.process_set = process_set

    def call(self, inputs: Any, training: Any = None, mask: Any = None) -> Any:
        if not training:
            return super().call(inputs, training=False)
        x = tf.convert_to_tensor(inputs)
        axes = self.axis if isinstance(self.axis, list | tuple) else [self.axis]
        axes = [a % x.shape.rank for a in axes]
        reduce_axes = [d for d in range(x.shape.rank) if d not in axes]
        compute = tf.float32 if x.dtype in (tf.float16, tf.bfloat16) else x.dtype
        xf = tf.cast(x, compute)
        local_sum = tf.reduce_sum(xf, axis=reduce_axes)
        local_sq = tf.reduce_sum(xf * xf, axis=reduce_axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), reduce_axes)), compute)
        flat = tf.concat([tf.reshape(local_sum, [-1]), tf.reshape(local_sq, [-1]), tf.reshape(count, [1])], 0)
        total = mpi_ops.allreduce(flat, op=ReduceOp.SUM, process_set=self.process_set)
        n = tf.size(local_sum)
        mean = tf.reshape(total[:n], tf.shape(local_sum)) / total[-1]
        var = tf.maximum(tf.reshape(total[n: 2 * n], tf.shape(local_sum)) / total[-1] - mean * mean, 0.0)
        self.moving_mean.assign(self.moving_mean * self.momentum + tf.cast(mean, self.moving_mean.dtype)
                                * (1.0 - self.momentum))
        self.moving_variance.assign(self.moving_variance * self.momentum
                                    + tf.cast(var, self.moving_variance.dtype) * (1.0 - self.momentum))
        shape = [1] * x.shape.rank
        for a in axes:
            shape[a] = x.shape[a]
        y = (xf - tf.reshape(mean, shape)) * tf.math.rsqrt(tf.reshape(var, shape) + self.epsilon)
        if self.scale:
            y = y * tf.cast(tf.reshape(self.gamma, shape), compute)
        if self.center:
            y = y + tf.cast(tf.reshape(self.beta, shape), compute)
        return tf.cast(y, x.dtype)


__all__ = ["SyncBatchNormalization"]
