"""Elastic training with a stateful compressor: a rank fails, the survivors restore, re-form the ring and go on.

One script for the TensorFlow bindings (``--framework``): tf (``DistributedGradientTape``
and ``hvd.elastic.TensorFlowState`` given the compressor), keras3 (hora.keras on
``KERAS_BACKEND``) and tfkeras (hora.tensorflow.keras), both with ``hvd.elastic.KerasState``,
which finds the optimizer's compressor itself.  The state is committed after
every step; the rank started as ``--fail-rank`` raises before step ``--fail-at``.

Every rank appends JSON lines to ``--logfile``: at each (re)start of the
training function, after the sync, its size, step and the compressor's
state (the sum of its residuals' magnitudes, a digest of its factors);
at the end its weights' digest and the compressor's step.
"""

import argparse
import hashlib
import json
import os

import numpy as np
from compression_data import batch, initial_weights, keras_model, tf_step

p = argparse.ArgumentParser()
p.add_argument("--framework", choices=["tf", "keras3", "tfkeras"], required=True)
p.add_argument("--logfile", required=True)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--fail-at", type=int, default=4)
p.add_argument("--fail-rank", type=int, default=2)
p.add_argument("--compression", default="powersgd:2")
args = p.parse_args()
START_RANK = int(os.environ.get("HOROVOD_RANK", "0"))




def digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def log(hvd, event: str, **values) -> None:
    with open(args.logfile, "a") as f:
        f.write(json.dumps({"event": event, "rank": hvd.rank(), "size": hvd.size(), "start_rank": START_RANK,
                            **values}) + "\n")


def log_start(hvd, compressor, step: int) -> None:
    tensors = compressor.state_dict()["tensors"]
    residual = sum(float(np.abs(np.asarray(t["residual"])).sum()) for t in tensors.values() if "residual" in t)
    factors = [np.asarray(tensors[n]["q"]) for n in sorted(tensors) if "q" in tensors[n]]
    log(hvd, "start", step=step, compressor_step=compressor.step, residual=residual, q=digest(factors))


def maybe_fail(step: int) -> None:
    if START_RANK == args.fail_rank and step == args.fail_at:
        raise RuntimeError(f"scheduled failure of start rank {START_RANK} at step {step}")


def run_tf() -> None:
    import tensorflow as tf

    import hora.tensorflow as hvd
    from hora.core.compression import parse_spec

    hvd.init()
    compression = parse_spec(args.compression)
    params = [tf.Variable(w) for w in initial_weights()]
    velocity = [tf.Variable(tf.zeros_like(v)) for v in params]
    state = hvd.elastic.TensorFlowState(params + velocity, step=0, compression=compression)

    @hvd.elastic.run
    def train(state):
        log_start(hvd, state.compression, state.step)
        while state.step < args.steps:
            maybe_fail(state.step)
            tf_step(tf, hvd, params, velocity, *batch(state.step, hvd.rank()), state.compression)
            state.step += 1
            state.commit()

    train(state)
    log(hvd, "end", step=state.step, compressor_step=compression.step, weights=digest(v.numpy() for v in params))
    hvd.shutdown()


def run_keras() -> None:
    if args.framework == "tfkeras":
        import tensorflow as tf

        import hora.tensorflow.keras as hvd

        keras = tf.keras
    else:
        import keras

        import hora.keras as hvd
    from hora.core.compression import parse_spec

    hvd.init()
    compression = parse_spec(args.compression)
    model = keras_model(keras, hvd, compression)
    state = hvd.elastic.KerasState(model, step=0)

    @hvd.elastic.run
    def train(state):
        log_start(hvd, compression, state.step)
        while state.step < args.steps:
            maybe_fail(state.step)
            model.train_on_batch(*batch(state.step, hvd.rank()))
            state.step += 1
            state.commit()

    train(state)
    log(hvd, "end", step=state.step, compressor_step=compression.step,
        weights=digest(np.asarray(w) for w in model.get_weights()))
    hvd.shutdown()


if __name__ == "__main__":
    {"tf": run_tf, "keras3": run_keras, "tfkeras": run_keras}[args.framework]()
