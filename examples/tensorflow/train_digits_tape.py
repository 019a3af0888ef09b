"""A custom TensorFlow training loop on handwritten digits: ``DistributedGradientTape`` inside a ``tf.function``.

Each rank trains on its own shard; the tape averages the gradients across
processes (one grouped allreduce per step, run inside the compiled step).
The variables are broadcast from rank 0 after the first step, as Horovod's
TF2 examples do.

Run on 2 processes::

    hora run -np 2 python examples/tensorflow/train_digits_tape.py --min-accuracy 0.95
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import hora.tensorflow as hvd  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=15, help="passes over this rank's shard")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one process (scaled by hvd.size())")
    p.add_argument("--seed", type=int, default=42, help="seed for the split and the weights")
    p.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this final test accuracy")
    return p.parse_args(argv)


def load_data(seed: int):
    """The digits as flat standardised float vectors, split the same way on every rank."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype("float32")
    y = digits.target.astype("int64")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    tf.random.set_seed(args.seed + hvd.rank())  # different initial weights: the broadcast must fix them

    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(128, activation="relu"),
                                 tf.keras.layers.Dense(10)])
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    dataset = (tf.data.Dataset.from_tensor_slices((x_tr, y_tr)).shard(hvd.size(), hvd.rank())
               .shuffle(2048, seed=args.seed).batch(args.batch_size, drop_remainder=True))
    step = 0
    for epoch in range(args.epochs):
        for x, y in dataset:
            loss = train_step(x, y)
            if step == 0:
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(opt.variables, root_rank=0)
            step += 1
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {float(loss):.4f}")

    part = slice(hvd.rank(), None, hvd.size())
    correct = float((np.argmax(model(x_te[part]).numpy(), 1) == y_te[part]).sum())
    totals = hvd.allreduce(tf.constant([correct, float(len(y_te[part]))], tf.float64), op=hvd.Sum).numpy()
    accuracy = float(totals[0] / totals[1])
    if hvd.rank() == 0:
        print(f"Test accuracy: {accuracy:.4f} ({hvd.size()} processes)")
    hvd.shutdown()
    return 1 if accuracy < args.min_accuracy else 0


if __name__ == "__main__":
    sys.exit(main())
