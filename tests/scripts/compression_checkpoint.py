"""Train with a stateful compressor, checkpointing mid-way; or resume from that checkpoint in a fresh process.

One script for every binding (``--framework``): torch, tf (``DistributedGradientTape``
with ``tf.train.Checkpoint`` and ``hvd.CompressionState``), keras3 (hora.keras on
``KERAS_BACKEND``, ``model.save`` / ``hvd.load_model``), tfkeras (hora.tensorflow.keras
under ``TF_USE_LEGACY_KERAS=1``, the same), mxnet (``DistributedTrainer.save_states``) and
mxnet-optimizer (``hvd.DistributedOptimizer`` under a plain ``gluon.Trainer``, whose
``save_states`` pickles the optimizer).

``--mode full`` trains all steps, saving each rank's checkpoint (model,
optimizer and the compressor's state) after ``--save-at`` steps; ``--mode
resume`` loads that checkpoint and trains the remaining steps.  Both write
each rank's final parameters to ``{mode}.{rank}.npz`` (and, with the
compressor's state at the checkpoint, ``saved-step.{rank}.txt``), which the
driver test compares.  The same inputs on every step: rank- and step-seeded.
"""

import argparse
import os
import pickle
from pathlib import Path

import numpy as np
from compression_data import SIZES, batch, initial_weights, keras_model, tf_step

p = argparse.ArgumentParser()
p.add_argument("--framework", choices=["torch", "tf", "keras3", "tfkeras", "mxnet", "mxnet-optimizer"],
               default="torch")
p.add_argument("--mode", choices=["full", "resume"], required=True)
p.add_argument("--dir", required=True)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--save-at", type=int, default=3)
p.add_argument("--compression", default="powersgd:2")
args = p.parse_args()
out = Path(args.dir)




def finish(rank: int, weights: list[np.ndarray], saved_step: int | None) -> None:
    np.savez(out / f"{args.mode}.{rank}.npz", *weights)
    if saved_step is not None:
        (out / f"saved-step.{rank}.txt").write_text(str(saved_step))


def run_torch() -> None:
    import torch

    import hora.torch as hvd
    from hora.core.compression import parse_spec

    hvd.init()
    rank = hvd.rank()
    layers = []
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(SIZES) - 2 else [])
    model = torch.nn.Sequential(*layers)
    with torch.no_grad():
        linear = [m for m in model if isinstance(m, torch.nn.Linear)]
        init = initial_weights()
        for m, k, b in zip(linear, init[::2], init[1::2], strict=True):
            m.weight.copy_(torch.from_numpy(k.T.copy()))
            m.bias.copy_(torch.from_numpy(b))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=parse_spec(args.compression))
    start, saved_step = 0, None
    if args.mode == "resume":
        saved = torch.load(out / f"ckpt.{rank}.pt")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
        if args.mode == "full" and step + 1 == args.save_at:
            state = opt.state_dict()
            saved_step = state["hora_compression"]["step"]
            torch.save({"model": model.state_dict(), "optimizer": state, "step": step + 1}, out / f"ckpt.{rank}.pt")
    finish(rank, [p.detach().numpy().copy() for p in model.parameters()], saved_step)
    hvd.shutdown()


def run_tf() -> None:
    """A plain TensorFlow model under ``DistributedGradientTape``; momentum SGD on tf.Variables."""
    import tensorflow as tf

    import hora.tensorflow as hvd
    from hora.core.compression import parse_spec

    tf.config.experimental.enable_op_determinism()
    hvd.init()
    rank = hvd.rank()
    compression = parse_spec(args.compression)
    params = [tf.Variable(w) for w in initial_weights()]
    velocity = [tf.Variable(tf.zeros_like(v)) for v in params]
    step_var = tf.Variable(0, dtype=tf.int64)
    ckpt = tf.train.Checkpoint(params=params, velocity=velocity, step=step_var,
                               compression=hvd.CompressionState(compression))
    if args.mode == "resume":
        ckpt.read(str(out / f"ckpt.{rank}")).assert_consumed()
    saved_step = None
    for step in range(int(step_var.numpy()), args.steps):
        tf_step(tf, hvd, params, velocity, *batch(step, rank), compression)
        step_var.assign(step + 1)
        if args.mode == "full" and step + 1 == args.save_at:
            ckpt.write(str(out / f"ckpt.{rank}"))
            saved_step = compression.state_dict()["step"]
    finish(rank, [v.numpy() for v in params], saved_step)
    hvd.shutdown()


def run_keras() -> None:
    """A Keras model (Keras 3 on its backend, or tf_keras): ``model.save`` mid-way, ``hvd.load_model`` to resume."""
    if args.framework == "tfkeras":
        import tensorflow as tf

        import hora.tensorflow.keras as hvd

        keras = tf.keras
    else:
        import keras

        import hora.keras as hvd
    from hora.core.compression import parse_spec

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_op_determinism()
    hvd.init()
    rank = hvd.rank()
    path = out / f"ckpt.{rank}.keras"
    start, saved_step = 0, None
    if args.mode == "resume":
        model = hvd.load_model(str(path), compression=parse_spec(args.compression))
        start = args.save_at
    else:
        model = keras_model(keras, hvd, parse_spec(args.compression))
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        model.train_on_batch(x, y)
        if args.mode == "full" and step + 1 == args.save_at:
            model.save(str(path))
            saved_step = (model.optimizer.compression_state_dict() or {}).get("step")
    finish(rank, [np.asarray(w) for w in model.get_weights()], saved_step)
    hvd.shutdown()


def run_mxnet() -> None:
    """A Gluon MLP under ``DistributedTrainer``: ``save_parameters`` + ``save_states`` mid-way."""
    import mxnet as mx
    from mxnet import autograd, gluon

    import hora.mxnet as hvd
    from hora.core.compression import parse_spec

    hvd.init()
    rank = hvd.rank()
    net = gluon.nn.Sequential()
    for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:], strict=True)):
        net.add(gluon.nn.Dense(b, in_units=a, activation="relu" if i < len(SIZES) - 2 else None))
    net.initialize()
    init = initial_weights()
    for layer, k, b in zip(net, init[::2], init[1::2], strict=True):
        layer.weight.set_data(mx.nd.array(k.T))
        layer.bias.set_data(mx.nd.array(b))
    if args.framework == "mxnet":
        trainer = hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.05, "momentum": 0.9},
                                         compression=parse_spec(args.compression))
    else:
        opt = hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.05, momentum=0.9),
                                       compression=parse_spec(args.compression))
        trainer = gluon.Trainer(net.collect_params(), opt, kvstore=None)
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    start, saved_step = 0, None
    if args.mode == "resume":
        net.load_parameters(str(out / f"ckpt.{rank}.params"))
        trainer.load_states(str(out / f"ckpt.{rank}.states"))
        start = args.save_at
    for step in range(start, args.steps):
        x, y = batch(step, rank)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y)).mean()
        loss.backward()
        trainer.step(1)  # the loss is a mean already
        if args.mode == "full" and step + 1 == args.save_at:
            net.save_parameters(str(out / f"ckpt.{rank}.params"))
            trainer.save_states(str(out / f"ckpt.{rank}.states"))
            if args.framework == "mxnet":
                with open(out / f"ckpt.{rank}.states.compression", "rb") as f:
                    saved_step = pickle.load(f)["step"]
            else:
                saved_step = min(s["step"] for s in opt.state_dict()["compression"].values())
    weights = []
    for layer in net:
        weights += [layer.weight.data().asnumpy().T, layer.bias.data().asnumpy()]
    finish(rank, weights, saved_step)
    hvd.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    {"torch": run_torch, "tf": run_tf, "keras3": run_keras, "tfkeras": run_keras, "mxnet": run_mxnet,
     "mxnet-optimizer": run_mxnet}[args.framework]()
