"""Data-parallel Keras training of a small CNN on handwritten digits with hora's Horovod API.

The script makes the changes a Horovod-with-Keras guide walks through, marked
``# (n)`` below: (1) import and init, (2) pin a GPU by local rank, (3) scale
the learning rate by the number of processes, (4) wrap the optimizer in
``hvd.DistributedOptimizer``, (5) broadcast the initial state from rank 0,
(6) average the metrics and warm the learning rate up, (7) write checkpoints
on rank 0 only, (8) divide the steps per epoch by the number of processes.
It runs on Keras 3 with the TensorFlow or torch backend (``KERAS_BACKEND``).

Data: scikit-learn's bundled 8x8 digits (1797 images, no download).

Run on 2 processes::

    hora run -np 2 python examples/keras/train_digits.py --min-accuracy 0.95
    KERAS_BACKEND=torch hora run -np 2 python examples/keras/train_digits.py
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import hora.keras as hvd  # noqa: E402  # (1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Hyperparameters as arguments, as the guide's script takes them; defaults reach >= 0.95."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=12, help="number of training epochs")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate for one process (scaled by hvd.size())")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--warmup-epochs", type=int, default=2, help="epochs of gradual learning-rate warmup")
    p.add_argument("--test-fraction", type=float, default=0.2, help="fraction of the data held out for testing")
    p.add_argument("--seed", type=int, default=42, help="seed for the split and the weights")
    p.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16")
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"),
                   help="where rank 0 writes the best model")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 1 when the final test accuracy is below this")
    return p.parse_args(argv)


def load_data(test_fraction: float, seed: int):
    """The digits as (N, 8, 8, 1) float images, split and standardised the same way on every rank."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype("float32")[..., None]
    y = digits.target.astype("int32")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    mean, std = float(x_tr.mean()), float(x_tr.std())
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def make_model(num_classes: int) -> keras.Model:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.25),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(num_classes),
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hvd.init()  # (1)
    if keras.backend.backend() == "tensorflow":  # (2) one GPU per process, by local rank
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    x_tr, y_tr, x_te, y_te = load_data(args.test_fraction, args.seed)
    shard = slice(hvd.rank(), None, hvd.size())  # each rank trains on its own part of the data
    x_mine, y_mine = x_tr[shard], y_tr[shard]

    keras.utils.set_random_seed(args.seed)
    model = make_model(int(y_tr.max()) + 1)
    lr = args.lr * hvd.size()  # (3)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=args.momentum),  # (4)
                                   compression=compression)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    steps_per_epoch = math.ceil(len(x_tr) / args.batch_size / hvd.size())  # (8)
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),  # (5)
        hvd.callbacks.MetricAverageCallback(),  # (6)
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=args.warmup_epochs,
                                                 steps_per_epoch=steps_per_epoch, momentum_correction=False,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:  # (7)
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        callbacks.append(keras.callbacks.ModelCheckpoint(str(args.checkpoint_dir / "digits-{epoch:02d}.keras")))

    repeats = math.ceil(steps_per_epoch * args.batch_size / len(x_mine))
    x_fit, y_fit = np.concatenate([x_mine] * repeats), np.concatenate([y_mine] * repeats)
    model.fit(x_fit, y_fit, batch_size=args.batch_size, steps_per_epoch=steps_per_epoch, epochs=args.epochs,
              callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0)

    # every rank scores its part of the test set; the sums give the global accuracy
    part = slice(hvd.rank(), None, hvd.size())
    logits = model.predict(x_te[part], verbose=0)
    correct = float((np.argmax(logits, axis=1) == y_te[part]).sum())
    totals = hvd.allreduce(np.array([correct, float(len(y_te[part]))]), op=hvd.Sum, name="test_accuracy")
    totals = keras.ops.convert_to_numpy(totals)
    accuracy = float(totals[0] / totals[1])
    if hvd.rank() == 0:
        print(f"Test accuracy: {accuracy:.4f} ({hvd.size()} processes, Keras {keras.__version__} on "
              f"{keras.backend.backend()})")
    hvd.shutdown()
    return 1 if accuracy < args.min_accuracy else 0


if __name__ == "__main__":
    sys.exit(main())
