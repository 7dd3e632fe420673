"""Warm start: a new model takes the layers it shares with a pre-trained one.

1. Pre-train a small classifier (a two-layer trunk and a 10-class head) on ten
   Gaussian blobs, saving checkpoints into `<workdir>/pretrain`.
2. Fine-tune a model with the same trunk and a new 3-class head (another shape) in
   `<workdir>/finetune`, with `warm_start=<workdir>/pretrain`: the session restores
   every leaf whose path, shape and dtype match and leaves the rest as `init_fn` made
   them; `sess.warm_start_report` lists which. The run stops half way.
3. Run the fine-tuning session again: it resumes from its OWN latest checkpoint, and
   the warm start is not applied again.

Run it with:

    .venv/bin/python examples/warm_start.py --steps 200

`--workdir` (default: a fresh temporary directory) receives both checkpoint directories
and `summary.json`. The last line says which leaves were restored and where the second
fine-tuning session resumed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmon as jm

FEATURES = 16


def make_blobs(num_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Ten Gaussian blobs in 16 dimensions: centres from seed 0, points from `seed`."""
    centres = np.random.default_rng(0).normal(size=(10, FEATURES))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=num_rows)
    points = centres[labels] + rng.normal(size=(num_rows, FEATURES))
    return points.astype(np.float32), labels.astype(np.int32)


class Classifier(nn.Module):
    """A trunk shared by both tasks (`trunk_0`, `trunk_1`) and a task's own `head`."""

    num_classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="trunk_0")(x))
        x = nn.relu(nn.Dense(64, name="trunk_1")(x))
        return nn.Dense(self.num_classes, name="head")(x)


def make_init_fn(num_classes: int, seed: int):
    def init_fn() -> jm.TrainState:
        model = Classifier(num_classes)
        params = model.init(jax.random.PRNGKey(seed), jnp.zeros((1, FEATURES)))["params"]
        return jm.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(3e-3))

    return init_fn


def step_fn(state: jm.TrainState, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}


def train(init_fn, data, checkpoint_dir, last_step, save_steps, warm_start=None):
    """One session up to `last_step`; returns (step at creation, warm start report,
    params at creation, final params, last accuracy)."""
    hooks = [jm.StopAtStepHook(last_step=last_step),
             jm.CheckpointSaverHook(checkpoint_dir, save_steps=save_steps, max_to_keep=None)]
    with jm.MonitoredSession(step_fn, init_fn, data=data, hooks=hooks, warm_start=warm_start) as sess:
        start_step, report = sess.step, sess.warm_start_report
        start_params = jax.device_get(sess.state.params)  # a host copy: the state is donated to the step
        outputs = {}
        while not sess.should_stop():
            outputs = sess.run()
        final_params = jax.device_get(sess.state.params)
    accuracy = float(outputs["accuracy"]) if outputs else float("nan")
    return start_step, report, start_params, final_params, accuracy


def print_report(report: jm.WarmStartReport) -> None:
    print(f"warm start from {report.source}:")
    for field in ("restored", "fresh", "mismatched", "unused", "skipped"):
        leaves = getattr(report, field)
        print(f"  {field:10s} ({len(leaves)}): " + (", ".join(leaves) if leaves else "-"))


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="pre-training steps, and fine-tuning steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workdir", default=None, help="checkpoints and summary.json (default: a new temp dir)")
    args = parser.parse_args(argv)
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="warm_start-"))
    pretrain_dir, finetune_dir = workdir / "pretrain", workdir / "finetune"
    half = max(args.steps // 2, 1)

    x, y = make_blobs(4000, seed=1)
    _, _, _, pretrained, accuracy = train(
        make_init_fn(10, seed=0), jm.ArrayDataSource({"x": x, "y": y}, args.batch_size, seed=0),
        pretrain_dir, last_step=args.steps, save_steps=half)
    print(f"pre-trained {args.steps} steps on 10 classes (batch accuracy {accuracy:.3f}) into {pretrain_dir}")

    # The new task: three groups of blobs. Same trunk, a new head of another shape.
    finetune_init = make_init_fn(3, seed=1)
    fresh = jax.device_get(finetune_init().params)
    finetune_data = jm.ArrayDataSource({"x": x, "y": y % 3}, args.batch_size, seed=1)
    start, report, warm, tuned, accuracy = train(finetune_init, finetune_data, finetune_dir, last_step=half,
                                                 save_steps=half, warm_start=pretrain_dir)
    print_report(report)
    trunk_restored = all(same(warm[name], pretrained[name]) for name in ("trunk_0", "trunk_1"))
    head_fresh = same(warm["head"], fresh["head"])
    print(f"fine-tuning started at step {start}: trunk equal to the pre-trained one: {trunk_restored}; "
          f"head equal to a fresh init: {head_fresh}")
    print(f"fine-tuned to step {half} on 3 classes (batch accuracy {accuracy:.3f}), then stopped")

    # Again, same directory, same warm_start argument: the run's own checkpoint wins.
    finetune_data = jm.ArrayDataSource({"x": x, "y": y % 3}, args.batch_size, seed=1)
    resumed_at, second_report, resumed, _, accuracy = train(
        finetune_init, finetune_data, finetune_dir, last_step=args.steps, save_steps=half, warm_start=pretrain_dir)
    print(f"second fine-tuning session resumed at step {resumed_at} from {finetune_dir} "
          f"(warm start report: {second_report}; params equal to where the first stopped: {same(resumed, tuned)}); "
          f"finished at step {args.steps} (batch accuracy {accuracy:.3f})")

    summary = {"pretrain_dir": str(pretrain_dir), "finetune_dir": str(finetune_dir), "steps": args.steps,
               "restored": report.restored, "fresh": report.fresh, "mismatched": report.mismatched,
               "unused": report.unused, "skipped": report.skipped, "start_step": start,
               "trunk_restored": trunk_restored,
               "head_fresh": head_fresh, "resumed_at": resumed_at,
               "second_warm_start_report": None if second_report is None else second_report._asdict(),
               "resumed_params_equal": same(resumed, tuned), "final_accuracy": accuracy}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    restored_params = [leaf for leaf in report.restored if leaf.startswith("params/")]
    print(f"warm start restored {len(restored_params)} parameter leaves ({', '.join(restored_params)}), left the "
          f"head fresh: {head_fresh}; the second session resumed at step {resumed_at} from its own checkpoint")


if __name__ == "__main__":
    main()
