"""TF1-style training on handwritten digits: ``tf.compat.v1`` graph, ``MonitoredTrainingSession`` and
``hvd.BroadcastGlobalVariablesHook(0)``, as Horovod's TensorFlow 1 guides write it.

Run on 2 processes::

    hora run -np 2 python examples/tensorflow/train_digits_v1.py --min-accuracy 0.95
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import hora.tensorflow as hvd  # noqa: E402

v1 = tf.compat.v1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="training steps (each process)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per process")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate for one process (scaled by hvd.size())")
    p.add_argument("--seed", type=int, default=42, help="seed for the split")
    p.add_argument("--checkpoint-dir", default=None, help="where rank 0 writes checkpoints (default: none)")
    p.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this final test accuracy")
    return p.parse_args(argv)


def load_data(seed: int):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(digits.data.astype("float32"), digits.target.astype("int64"),
                                              test_size=0.2, random_state=seed, stratify=digits.target)
    mean, std = x_tr.mean(), x_tr.std()
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def dense(x, fan_in: int, fan_out: int, name: str):
    """A fully connected layer from tf.compat.v1 variables (v1.layers is gone with Keras 3)."""
    w = v1.get_variable(f"{name}/kernel", [fan_in, fan_out], initializer=v1.glorot_uniform_initializer())
    b = v1.get_variable(f"{name}/bias", [fan_out], initializer=v1.zeros_initializer())
    return tf.matmul(x, w) + b


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    v1.disable_eager_execution()
    hvd.init()
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    x_mine, y_mine = x_tr[hvd.rank()::hvd.size()], y_tr[hvd.rank()::hvd.size()]

    images = v1.placeholder(tf.float32, [None, 64])
    labels = v1.placeholder(tf.int64, [None])
    hidden = tf.nn.relu(dense(images, 64, 128, "hidden"))
    logits = dense(hidden, 128, 10, "logits")
    loss = v1.losses.sparse_softmax_cross_entropy(labels, logits)
    global_step = v1.train.get_or_create_global_step()
    opt = v1.train.MomentumOptimizer(args.lr * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt)
    train_op = opt.minimize(loss, global_step=global_step)
    predictions = tf.argmax(logits, 1)

    part = slice(hvd.rank(), None, hvd.size())  # each rank scores its part of the test set

    class Evaluate(v1.train.SessionRunHook):
        """Predicts the test set with the trained weights when the session ends."""

        def end(self, session):
            self.predicted = session.run(predictions, {images: x_te[part]})

    evaluate = Evaluate()
    hooks = [hvd.BroadcastGlobalVariablesHook(0), v1.train.StopAtStepHook(last_step=args.steps), evaluate]
    checkpoint_dir = args.checkpoint_dir if hvd.rank() == 0 else None  # rank 0 alone writes checkpoints
    rng = np.random.default_rng(args.seed + hvd.rank())
    with v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks) as sess:
        step = 0
        while not sess.should_stop():
            idx = rng.integers(0, len(x_mine), args.batch_size)
            _, value = sess.run([train_op, loss], {images: x_mine[idx], labels: y_mine[idx]})
            step += 1
            if hvd.rank() == 0 and step % 100 == 0:
                print(f"step {step}: loss {value:.4f}")
    correct = float((evaluate.predicted == y_te[part]).sum())
    counts = np.array([correct, float(len(y_te[part]))])
    totals = hvd.allgather_object(counts)
    accuracy = sum(t[0] for t in totals) / sum(t[1] for t in totals)
    if hvd.rank() == 0:
        print(f"Test accuracy: {accuracy:.4f} ({hvd.size()} processes)")
    hvd.shutdown()
    return 1 if accuracy < args.min_accuracy else 0


if __name__ == "__main__":
    sys.exit(main())
