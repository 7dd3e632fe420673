"""TF 1.x `tf.compat.v1.train.MonitoredTrainingSession` with its default hooks (step
counter and summaries every 100 steps, a checkpoint every 1000), `LoggingTensorHook`
(the loss every 100 iterations) and `NanTensorHook`: the system jaxmon replaces. A peer
worker of `benchmarks/suite.py` (see `serve.py`).

Graph mode, the workload's batch as constants (data on the device, as jaxmon's
variants have it), `AdamOptimizer`. Run by the suite with an environment that has
tensorflow-cpu: see `make bench-peers`.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tensorflow as tf  # noqa: E402
import workload  # noqa: E402
from serve import serve  # noqa: E402

tf1 = tf.compat.v1
tf1.disable_eager_execution()


def measure(name: str):
    layers, x, y = workload.arrays(name)
    activation = {"tanh": tf.tanh, "relu": tf.nn.relu}[workload.SPECS[name]["activation"]]

    def run(variant: str, steps: int, warmup: int) -> float:
        if variant != "tf1_mts":
            raise ValueError(f"unknown variant {variant!r}")
        with tf.Graph().as_default(), tempfile.TemporaryDirectory() as checkpoint_dir:
            global_step = tf1.train.get_or_create_global_step()
            h = tf.constant(x)
            for i, (w, b) in enumerate(layers):
                h = h @ tf1.get_variable(f"w{i}", initializer=w) + tf1.get_variable(f"b{i}", initializer=b)
                h = activation(h) if i < len(layers) - 1 else h
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.constant(y), logits=h))
            tf1.summary.scalar("loss", loss)
            train_op = tf1.train.AdamOptimizer(workload.LEARNING_RATE).minimize(loss, global_step=global_step)
            hooks = [tf1.train.LoggingTensorHook({"loss": loss}, every_n_iter=100), tf1.train.NanTensorHook(loss)]
            with tf1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, hooks=hooks,
                                                    save_checkpoint_steps=1000, save_summaries_steps=100,
                                                    log_step_count_steps=100) as sess:
                for _ in range(warmup):
                    sess.run(train_op)
                start = time.perf_counter()
                for _ in range(steps):
                    sess.run(train_op)
                elapsed = time.perf_counter() - start
        return elapsed / steps * 1e6

    return run


if __name__ == "__main__":
    log = logging.getLogger("tensorflow")  # its hooks' log lines, formatted into the void as jaxmon's are
    log.handlers = [logging.StreamHandler(open(os.devnull, "w"))]  # noqa: SIM115
    log.setLevel(logging.INFO)
    log.propagate = False
    serve(measure(sys.argv[1]), {"tensorflow": tf.__version__})
