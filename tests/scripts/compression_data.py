"""The model and data the compression checkpoint and elastic scripts share: an MLP 20-32-32-4, rank-seeded batches.

Its matrices are large enough for PowerSGD at rank 2 to compress them
(``min_compression_rate`` 2), and every input is a function of the step
and the rank, so a resumed run sees what an uninterrupted one saw.
"""

import numpy as np

SIZES = (20, 32, 32, 4)


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Sixteen samples and labels for ``rank`` at ``step``."""
    rng = np.random.default_rng(100 * step + rank)
    return rng.standard_normal((16, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], 16)


def initial_weights() -> list[np.ndarray]:
    """(kernel, bias) per layer, kernels as (in, out); the same on every rank."""
    rng = np.random.default_rng(7)
    layers = []
    for a, b in zip(SIZES[:-1], SIZES[1:], strict=True):
        layers += [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32), np.zeros(b, np.float32)]
    return layers


def tf_step(tf, hvd, params: list, velocity: list, x: np.ndarray, y: np.ndarray, compression) -> None:
    """One momentum-SGD step of the MLP on ``tf.Variable`` objects, its gradients through a DistributedGradientTape."""
    with tf.GradientTape() as tape:
        h = x
        for i in range(0, len(params), 2):
            h = tf.matmul(h, params[i]) + params[i + 1]
            if i + 2 < len(params):
                h = tf.nn.relu(h)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
    tape = hvd.DistributedGradientTape(tape, compression=compression)
    for var, vel, g in zip(params, velocity, tape.gradient(loss, params), strict=True):
        vel.assign(0.9 * vel + g)
        var.assign_sub(0.05 * vel)


def keras_model(keras, hvd, compression):
    """The MLP as a compiled Keras model whose optimizer is hora's, with ``compression``."""
    layers = [keras.Input((SIZES[0],))]
    for i, b in enumerate(SIZES[1:]):
        layers.append(keras.layers.Dense(b, activation="relu" if i < len(SIZES) - 2 else None))
    model = keras.Sequential(layers)
    model.set_weights(initial_weights())
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compression=compression)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
