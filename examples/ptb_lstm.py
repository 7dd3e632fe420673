"""TensorFlow's PTB word-level LSTM (`tutorials/rnn/ptb/ptb_word_lm.py`) on jaxmon.

The TF script trained a two-layer LSTM language model under `tf.train.Supervisor` and
`sv.managed_session()`. Its patterns, and what each is here:

- The LSTM's `final_state`, fed back as `initial_state` at every `session.run`, and
  reset to zeros when `run_epoch` starts an epoch: the state lives in
  `TrainState.extras`, and the step starts from zeros where `step % epoch_size == 0`.
  It is part of the train state, so checkpoints hold it and a resumed run goes on
  with the same sequence.
- `m.assign_lr(session, lr * lr_decay)` before each epoch: an optax schedule of the
  step (`lr_at`), computed on the device.
- `run_epoch`'s perplexity, `np.exp(costs / iters)` over the epoch's steps: one
  reduction, `jm.Ratio("cost", iters).then(np.exp)`, reported every `epoch_size`
  steps; the report at step E covers steps 1..E (the record after step 1, the starting
  point, does not end the window).
- The validation run each epoch: `jm.EvalHook(..., carry=...)`, whose `eval_fn` takes
  the state the previous validation batch ended with.
- The one-off test run on the final state with its own batch shape (TF's
  `eval_config`: batch 1, one step per run): an `EvalHook` with no period, which
  evaluates once, at the end.
- `iters` is not a step output: every scalar output becomes a summary (the session's
  `SummarySaverHook`), and a constant `iters = 20` would be written as one. The
  reduction computes it from the batch instead.

The text is words of Python's standard-library sources (nothing is downloaded). Run:

    .venv/bin/python examples/ptb_lstm.py --workdir /tmp/ptb

It logs each epoch's train and validation perplexity, writes `metrics.jsonl` and
TensorBoard events into `--workdir`, and ends with `test perplexity N`. Run the same
command again after an interruption (even SIGKILL) to go on from the last checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import heapq
import inspect
import pathlib
import re
import tempfile
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon as jm

# -- the data: TF's `reader.ptb_raw_data` and `ptb_producer` --------------------------------


def word_ids(vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The train, validation and test words (80/10/10) as ids; the `vocab_size - 1`
    commonest words have their own id, the others share `<unk>` (the last)."""
    text = "\n".join(pathlib.Path(inspect.getsourcefile(module)).read_text(encoding="utf-8")
                     for module in (textwrap, heapq, functools, contextlib, collections))
    words = re.findall(r"\w+|[^\w\s]", text)
    common = [word for word, _ in collections.Counter(words).most_common(vocab_size - 1)]
    index = {word: i for i, word in enumerate(common)}
    ids = np.array([index.get(word, vocab_size - 1) for word in words], np.int32)
    a, b = int(len(ids) * 0.8), int(len(ids) * 0.9)
    return ids[:a], ids[a:b], ids[b:]


def batches(ids: np.ndarray, batch_size: int, num_steps: int) -> list[dict[str, np.ndarray]]:
    """One epoch as TF's `ptb_producer` cut it: `batch_size` rows of consecutive
    words, batch i the columns [i * num_steps, (i + 1) * num_steps), the targets one
    word later; consecutive batches continue each row."""
    columns = len(ids) // batch_size
    rows = ids[:batch_size * columns].reshape(batch_size, columns)
    return [{"x": rows[:, i * num_steps:(i + 1) * num_steps], "y": rows[:, i * num_steps + 1:(i + 1) * num_steps + 1]}
            for i in range((columns - 1) // num_steps)]


class Epochs:
    """The epoch's batches in order, `count` times (or until `last_step` batches were
    read in all), resumable (`get_state`/`set_state`)."""

    def __init__(self, epoch: list[dict[str, np.ndarray]], count: int, last_step: int | None = None):
        self.epoch, self.position = epoch, 0
        self.end = count * len(epoch) if last_step is None else min(last_step, count * len(epoch))

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.position >= self.end:
            raise StopIteration
        self.position += 1
        return self.epoch[(self.position - 1) % len(self.epoch)]

    def get_state(self) -> dict[str, int]:
        return {"position": self.position}

    def set_state(self, state: dict[str, int]) -> None:
        self.position = state["position"]


# -- the model: TF's `PTBModel` -------------------------------------------------------------


class PTBModel(nn.Module):
    """Embedding, `layers` LSTMs, a linear read-out; takes and returns the LSTM states."""

    vocab_size: int
    hidden: int
    layers: int = 2

    @nn.compact
    def __call__(self, carry, x):
        x = nn.Embed(self.vocab_size, self.hidden)(x)
        new_carry = []
        for layer in range(self.layers):
            state, x = nn.RNN(nn.OptimizedLSTMCell(self.hidden), return_carry=True)(x, initial_carry=carry[layer])
            new_carry.append(state)
        return tuple(new_carry), nn.Dense(self.vocab_size)(x)


def zero_state(model: PTBModel, batch_size: int):
    """TF's `cell.zero_state`: every layer's (c, h) at zero."""
    shape = (batch_size, model.hidden)
    return tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in range(model.layers))


def lm_cost(params, apply_fn, carry, batch):
    """TF's `cost`: the cross-entropy summed over the time steps, averaged over the
    batch; and the LSTM states at the batch's end."""
    carry, logits = apply_fn({"params": params}, carry, batch["x"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return losses.sum(axis=1).mean(), carry


def iters(state, batch, outputs):
    """TF's `iters`: the time steps of a batch."""
    return batch["x"].shape[1]


# -- the port: what `ptb_word_lm.main` did with the session ---------------------------------

PERPLEXITY = jm.Ratio("cost", iters).then(np.exp)  # run_epoch's np.exp(costs / iters)


def train(workdir, model, data, *, batch_size, num_steps, max_epoch, max_max_epoch, lr=1.0, lr_decay=0.5,
          last_step=None):
    train_batches = batches(data[0], batch_size, num_steps)
    epoch_size = len(train_batches)

    def lr_at(step):  # assign_lr(session, lr * lr_decay ** max(i + 1 - max_epoch, 0)) before epoch i
        return lr * lr_decay ** jnp.maximum(step // epoch_size + 1 - max_epoch, 0)

    def init_fn():
        params = model.init(jax.random.key(0), zero_state(model, batch_size), train_batches[0]["x"])["params"]
        return jm.TrainState.create(apply_fn=model.apply, params=params, extras=zero_state(model, batch_size),
                                    tx=optax.chain(optax.clip_by_global_norm(5.0), optax.sgd(lr_at)))

    def step_fn(state, batch):
        epoch_start = state.step % epoch_size == 0  # run_epoch began from model.initial_state
        carry = jax.tree.map(lambda c: jnp.where(epoch_start, 0.0, c), state.extras)
        (cost, carry), grads = jax.value_and_grad(lm_cost, has_aux=True)(state.params, state.apply_fn, carry, batch)
        return state.apply_gradients(grads=grads).replace(extras=carry), {"cost": cost}

    def eval_fn(state, batch, carry):  # each split's batches continue the state, as TF's run_epoch
        cost, carry = lm_cost(state.params, state.apply_fn, carry, batch)
        return {"cost": cost}, carry

    valid = jm.EvalHook(eval_fn, batches(data[1], batch_size, num_steps), every_n_steps=epoch_size, prefix="valid",
                        carry=zero_state(model, batch_size), metrics={"perplexity": PERPLEXITY})
    test = jm.EvalHook(eval_fn, batches(data[2], 1, 1), prefix="test", carry=zero_state(model, 1),
                       metrics={"perplexity": PERPLEXITY})  # no period: once, on the final state
    hooks = [jm.LoggingHook({"train perplexity": PERPLEXITY}, every_n_iter=epoch_size), valid, test]
    epochs = jm.SummarySaverHook(save_steps=epoch_size, output_dir=workdir, output_scalars=False,
                                 summaries={"train/perplexity": PERPLEXITY})
    with jm.MonitoredTrainingSession(step_fn, init_fn, data=Epochs(train_batches, max_max_epoch, last_step),
                                     checkpoint_dir=workdir, save_checkpoint_steps=epoch_size,
                                     chief_only_hooks=[epochs], hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run()
    return test.latest["perplexity"]

# -- end of the port ------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="checkpoints and summaries (default: a new temporary one)")
    parser.add_argument("--vocab", type=int, default=2000, help="the vocabulary size")
    parser.add_argument("--hidden", type=int, default=128, help="the LSTM size")
    parser.add_argument("--batch-size", type=int, default=20)
    parser.add_argument("--num-steps", type=int, default=20, help="the time steps per batch (unrolled)")
    parser.add_argument("--words", type=int, default=None, help="use only the first N words of each split")
    parser.add_argument("--max-epoch", type=int, default=4, help="epochs at the full learning rate")
    parser.add_argument("--max-max-epoch", type=int, default=6, help="epochs in all")
    parser.add_argument("--last-step", type=int, default=None, help="stop after this step (run again to go on)")
    args = parser.parse_args()
    data = tuple(split[:args.words] for split in word_ids(args.vocab))
    perplexity = train(args.workdir or tempfile.mkdtemp(prefix="ptb-"), PTBModel(args.vocab, args.hidden), data,
                       batch_size=args.batch_size, num_steps=args.num_steps, max_epoch=args.max_epoch,
                       max_max_epoch=args.max_max_epoch, last_step=args.last_step)
    print(f"test perplexity {perplexity:.2f}")


if __name__ == "__main__":
    main()
