"""A character-level transformer language model, trained on Python's own sources.

The text is the source of a few standard-library modules (found with
`inspect.getsourcefile`, so nothing is downloaded), split into a training part and a
held-out validation part. The model is a small Flax linen transformer: a character
embedding plus learned positions, two pre-norm blocks of causal self-attention and an
MLP, and a linear read-out.

The steps output token *sums* (`loss_sum`, `tokens`), as research code does, and the
metrics are built-in reductions over them: the train loss is `jm.Ratio("loss_sum",
"tokens")` over each summary window, the perplexity that `.then(np.exp)`, and the
validation loss the same ratio over the whole validation set (its last batch is padded
and masked, so batches hold unequal token counts). Hooks: `EvalHook` (before training,
every N steps and at the end), `SummarySaverHook` (TensorBoard events and
`metrics.jsonl` in `--workdir`, shared with the `EvalHook`), `LoggingHook` and
`StopAtStepHook`. At the end the model writes ~100 characters of Python, one sampled
character at a time.

Run it with:

    .venv/bin/python examples/char_lm.py --steps 300

It prints the generated text between `--- sample ---` and `--- end ---`, writes
`summary.json` into `--workdir` (default: a fresh temporary directory), and ends with
a line such as `validation loss 5.09 -> 1.87 nats/char (unigram entropy 3.07, ...)`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fractions
import functools
import heapq
import inspect
import json
import logging
import math
import pathlib
import queue
import shlex
import tempfile
import textwrap
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon as jm

MODULES = (textwrap, heapq, functools, contextlib, fractions, queue, shlex, collections)


def load_text() -> str:
    """The modules' sources, concatenated; characters outside ASCII become '?'."""
    sources = [pathlib.Path(inspect.getsourcefile(module)).read_text(encoding="utf-8") for module in MODULES]
    return "".join(char if ord(char) < 128 else "?" for char in "\n".join(sources))


def windows(tokens: np.ndarray, length: int) -> np.ndarray:
    """Non-overlapping windows of `length` tokens, one per row."""
    rows = len(tokens) // length
    return tokens[:rows * length].reshape(rows, length)


def unigram_entropy(tokens: np.ndarray) -> float:
    """The entropy of the character frequencies, in nats: a model that ignores context."""
    counts = np.bincount(tokens).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(nn.LayerNorm()(x), mask=mask)
        h = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


class CharTransformer(nn.Module):
    vocab_size: int
    context: int
    d_model: int = 64
    layers: int = 2
    heads: int = 4

    @nn.compact
    def __call__(self, tokens):
        position = self.param("position", nn.initializers.normal(0.02), (self.context, self.d_model))
        x = nn.Embed(self.vocab_size, self.d_model)(tokens) + position[None, :tokens.shape[1]]
        for _ in range(self.layers):
            x = Block(self.heads)(x)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


def next_char_sums(apply_fn, params, tokens, mask):
    """The summed cross-entropy (nats) of predicting tokens[:, 1:] from tokens[:, :-1]
    where `mask[:, 1:]` is 1, and how many tokens that is."""
    logits = apply_fn({"params": params}, tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    weights = mask[:, 1:].astype(losses.dtype)
    return (losses * weights).sum(), weights.sum()


def step_fn(state: jm.TrainState, batch):
    def loss_fn(params):
        loss_sum, tokens = next_char_sums(state.apply_fn, params, batch["tokens"], batch["mask"])
        return loss_sum / tokens, (loss_sum, tokens)

    (_, (loss_sum, tokens)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), {"loss_sum": loss_sum, "tokens": tokens}


def eval_fn(state: jm.TrainState, batch):
    loss_sum, tokens = next_char_sums(state.apply_fn, state.params, batch["tokens"], batch["mask"])
    return {"loss_sum": loss_sum, "tokens": tokens}


#: The token-weighted loss of a window of steps, or of a whole evaluation, and its perplexity.
LOSS = jm.Ratio("loss_sum", "tokens")
PERPLEXITY = LOSS.then(np.exp)


class Data(NamedTuple):
    """The training rows, the validation batches and the alphabet."""

    train: np.ndarray
    val_batches: list[dict[str, np.ndarray]]
    chars: list[str]
    entropy: float


def load_data(context: int, batch_size: int, eval_batches: int) -> Data:
    """Rows of `context + 1` characters (inputs and, shifted by one, targets): the
    training rows, and up to `eval_batches` validation batches of `batch_size` rows,
    the last padded with masked rows when the rows run out."""
    text = load_text()
    chars = sorted(set(text))
    index = {char: i for i, char in enumerate(chars)}
    tokens = np.array([index[char] for char in text], np.int32)
    split = int(0.9 * len(tokens))
    train, val = windows(tokens[:split], context + 1), windows(tokens[split:], context + 1)
    val = val[:eval_batches * batch_size - batch_size // 2]  # a last batch half full
    batches = []
    for start in range(0, len(val), batch_size):
        rows = val[start:start + batch_size]
        mask = np.zeros((batch_size, context + 1), np.int32)
        mask[:len(rows)] = 1
        padded = np.zeros((batch_size, context + 1), np.int32)
        padded[:len(rows)] = rows
        batches.append({"tokens": padded, "mask": mask})
    return Data(train, batches, chars, unigram_entropy(tokens[:split]))


def make_init_fn(model: CharTransformer, context: int):
    """The state's `init_fn`: the same parameters every time (seed 0)."""
    @jax.jit  # one compilation, instead of one small program per initialiser run eagerly
    def init_fn() -> jm.TrainState:
        params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, context), jnp.int32))["params"]
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(3e-3))
        return jm.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return init_fn


@functools.partial(jax.jit, static_argnames=("apply_fn", "length"))
def generate(apply_fn, params, prompt, key, temperature, length):
    """Samples `length` tokens after `prompt` (context-sized), one compiled loop."""
    def one(i, carry):
        window, out, key = carry
        key, sample_key = jax.random.split(key)
        logits = apply_fn({"params": params}, window[None])[0, -1]
        token = jax.random.categorical(sample_key, logits / temperature)
        return jnp.append(window[1:], token), out.at[i].set(token), key

    out = jnp.zeros((length,), prompt.dtype)
    _, out, _ = jax.lax.fori_loop(0, length, one, (prompt, out, key))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=64, help="characters the model sees")
    parser.add_argument("--eval-batches", type=int, default=8, help="validation batches per evaluation")
    parser.add_argument("--sample-length", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--workdir", default=None, help="summaries and summary.json (default: a new temp dir)")
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="char_lm-"))
    logging.getLogger("jaxmon").setLevel(logging.INFO)  # show the hooks' lines

    data = load_data(args.context, args.batch_size, args.eval_batches)
    chars, entropy = data.chars, data.entropy
    index = {char: i for i, char in enumerate(chars)}
    print(f"{len(data.train) * (args.context + 1)} training characters from {len(MODULES)} modules, "
          f"{len(chars)} distinct; unigram entropy {entropy:.3f} nats/char")
    train = jm.ArrayDataSource({"tokens": data.train, "mask": np.ones_like(data.train)}, args.batch_size, seed=0)
    model = CharTransformer(len(chars), args.context)

    every = max(args.steps // 4, 1)
    evaluate = jm.EvalHook(eval_fn, data.val_batches, every_n_steps=every, output_dir=workdir, at_start=True,
                           metrics={"loss": LOSS, "perplexity": PERPLEXITY})
    hooks = [jm.StopAtStepHook(last_step=args.steps), evaluate,
             jm.SummarySaverHook(save_steps=max(every // 5, 1), output_dir=workdir, output_scalars=False,
                                 summaries={"train/loss": LOSS, "train/perplexity": PERPLEXITY}),
             jm.LoggingHook({"loss": LOSS, "perplexity": PERPLEXITY}, every_n_iter=every)]
    with jm.MonitoredSession(step_fn, make_init_fn(model, args.context), data=train, hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run()
        params = sess.state.params

    prompt_text = "    def "
    prompt = np.full(args.context, index["\n"], np.int32)  # newlines before the prompt
    prompt[-len(prompt_text):] = [index[char] for char in prompt_text]
    sampled = generate(model.apply, params, jnp.asarray(prompt), jax.random.PRNGKey(1),
                       args.temperature, args.sample_length)
    sample = prompt_text + "".join(chars[i] for i in np.asarray(sampled))
    print("--- sample ---")
    print(sample)
    print("--- end ---")

    history = [{"step": step, "loss": metrics["loss"], "perplexity": metrics["perplexity"]}
               for step, metrics in evaluate.history]
    (workdir / "summary.json").write_text(json.dumps(
        {"unigram_entropy": entropy, "vocab_size": len(chars), "steps": sess.step,
         "eval_compilations": evaluate.trace_count, "history": history, "sample": sample}, indent=1))
    first, last = history[0]["loss"], history[-1]["loss"]
    print(f"validation loss {first:.3f} -> {last:.3f} nats/char (unigram entropy {entropy:.3f}, "
          f"{math.exp(last):.1f} perplexity) after {sess.step} steps")


if __name__ == "__main__":
    main()
