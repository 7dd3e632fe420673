"""Tasks of config-driven runs: what trains the model, the built-in ones and a user's.

A task turns the built parts of a config (the model, the optimizer, an example batch,
the mesh) into the three functions a run needs. The built-in tasks ("classification",
"regression", "lm") are a loss on the model's predictions; a user's task is any function
`make_task(context) -> jm.Task`, named by import path (`task: "my_tasks:make_task"`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmon._base.errors import ConfigError
from jaxmon._experiment.keys import TASK_PARTS, resolve
from jaxmon._experiment.sections import learning_rate_of
from jaxmon._metrics.reductions import Ratio, Reduction
from jaxmon._run.train_state import TrainState

__all__ = ["Task", "TaskContext", "task_of"]


class Task(NamedTuple):
    """What a task gives a config-driven run (`jaxmon train`).

    Attributes:
      init_fn: `init_fn() -> state`, the fresh state (a `jm.TrainState`, or any pytree).
        It may shard the state itself (`jax.jit(init, out_shardings=...)` on
        `context.mesh`): the run keeps those shardings.
      step_fn: `step_fn(state, batch) -> (new_state, {name: scalar})`, one training step.
      eval_fn: `eval_fn(state, batch) -> {name: scalar}` on one batch of the eval split.
      eval_metrics: `{name: jm.Reduction}` over `eval_fn`'s outputs, reduced over the
        whole eval split (e.g. `{"loss": jm.Ratio("loss_sum", "tokens")}`); other
        outputs are averaged weighted by batch size. None: all of them so.

    Example (`my_tasks.py` beside the config, `task: "my_tasks:make_task"`):
      >>> import jax, jax.numpy as jnp, optax, jaxmon as jm
      >>> def make_task(context):
      ...     def init_fn():
      ...         return {"w": jnp.zeros(()), "opt": context.optimizer.init(jnp.zeros(()))}
      ...     def loss(w, batch):
      ...         return jnp.mean((w * batch["x"] - batch["y"]) ** 2)
      ...     def step_fn(state, batch):
      ...         value, grad = jax.value_and_grad(loss)(state["w"], batch)
      ...         updates, opt = context.optimizer.update(grad, state["opt"], state["w"])
      ...         return {"w": optax.apply_updates(state["w"], updates), "opt": opt}, {"loss": value}
      ...     def eval_fn(state, batch):
      ...         return {"loss": loss(state["w"], batch)}
      ...     return jm.Task(init_fn, step_fn, eval_fn)
    """

    init_fn: Callable[[], Any]
    step_fn: Callable[[Any, Any], tuple[Any, Mapping[str, Any]]]
    eval_fn: Callable[[Any, Any], Mapping[str, Any]]
    eval_metrics: Mapping[str, Reduction] | None = None


class TaskContext(NamedTuple):
    """What a user's `make_task(context)` gets from the config.

    Attributes:
      config: the whole experiment config (a dict; read your own keys from it).
      model: the Flax module the `model` section builds, or None without one.
      optimizer: the optax optimizer the `optimizer` section builds, or None.
      seed: the config's `seed`.
      example_batch: the first rows of the train split (`{key: np.ndarray}`), for shapes.
      mesh: the run's `jax.sharding.Mesh` (the `mesh` section), or None on one device.
    """

    config: Mapping[str, Any]
    model: Any
    optimizer: optax.GradientTransformation | None
    seed: int
    example_batch: Mapping[str, np.ndarray]
    mesh: jax.sharding.Mesh | None


def classification(logits: jax.Array, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Softmax cross-entropy on integer labels `batch["y"]`, and accuracy."""
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["y"])}


def regression(predictions: jax.Array, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The mean squared error against `batch["y"]`."""
    return jnp.mean((predictions - batch["y"]) ** 2), {}


#: The lm task's sums, which its eval metrics divide (`keys.TASK_PARTS`).
_LOSS_SUM, _TOKENS, _CORRECT = TASK_PARTS["lm"]


def lm(logits: jax.Array, batch: Mapping[str, Any], pad_id: int | None = None
       ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross-entropy: `logits` (batch, length, vocab) for the targets
    `batch["y"]` (batch, length), where a target equal to `pad_id` (the config's
    `data.pad_id`; None: the data has no padding) counts for nothing.

    Returns:
      The mean over the real tokens, and their sums (`loss_sum`, `correct`) and count
      (`tokens`), which the eval metrics reduce over the whole eval split.
    """
    targets = batch["y"]
    weights = jnp.ones(targets.shape, jnp.float32) if pad_id is None else (targets != pad_id).astype(jnp.float32)
    losses = cross_entropy(logits, targets)
    tokens = weights.sum()
    loss_sum = (losses * weights).sum()
    correct = ((jnp.argmax(logits, -1) == targets) * weights).sum()
    return loss_sum / jnp.maximum(tokens, 1.0), {_LOSS_SUM: loss_sum, _TOKENS: tokens, _CORRECT: correct}


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """`-log softmax(logits)[target]` of each row of `logits` (..., vocab), in float32
    whatever the logits' dtype, with integer `targets` (...). Its gradient keeps only the
    logits as they are and one float32 log-sum-exp a row (optax's, on logits cast to
    float32, keeps a float32 copy of them: twice a bfloat16 model's, for the vocabulary
    of every token of the batch).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> logits, targets = jnp.array([[2.0, 1.0, 0.1]]), jnp.array([0])
      >>> bool(jnp.allclose(cross_entropy(logits, targets),
      ...                   optax.softmax_cross_entropy_with_integer_labels(logits, targets)))
      True
    """
    return _cross_entropy_forward(logits, targets)[0]


def _cross_entropy_forward(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple]:
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
    return lse - picked, (logits, targets, lse)


def _cross_entropy_backward(kept: tuple, grad: jax.Array) -> tuple[jax.Array, None]:
    logits, targets, lse = kept
    probabilities = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
    hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
    return ((probabilities - hot) * grad[..., None]).astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)


#: The "lm" task's eval metrics: token-weighted over the whole eval split.
LM_METRICS = {"loss": Ratio(_LOSS_SUM, _TOKENS), "perplexity": Ratio(_LOSS_SUM, _TOKENS).then(np.exp),
              "accuracy": Ratio(_CORRECT, _TOKENS)}

_BUILT_IN = {"classification": (classification, None, ()), "regression": (regression, None, ()),
             "lm": (lm, LM_METRICS, TASK_PARTS["lm"])}


def task_of(task: Any) -> Callable[[TaskContext], Task]:
    """The function that builds the run's `Task` from a `TaskContext`, for the `task` key.

    Args:
      task: "classification", "regression", "lm", or an import path of either a
        user's `make_task(context) -> jm.Task` (one parameter) or a loss
        `fn(predictions, batch) -> (loss, {metric: value})` (two parameters) that
        the model's predictions are trained on.

    Raises:
      ConfigError: `task` is none of these.
    """
    if isinstance(task, str) and task in _BUILT_IN:
        return _model_task(*_BUILT_IN[task])
    if isinstance(task, str) and (":" in task or "." in task):
        fn = resolve(task, "task")
        if _parameter_count(fn) == 1:
            return _user_task(fn, task)
        return _model_task(fn, None)
    raise ConfigError(f"task must be one of {', '.join(map(repr, _BUILT_IN))}, or the import path of "
                      "make_task(context) -> jm.Task or of fn(predictions, batch) -> (loss, metrics) "
                      f"(e.g. 'my_tasks:make_task'); got {task!r}.")


def is_built_in(task: Any) -> bool:
    """Whether `task` names a built-in task (a `TrainState` of the config's model)."""
    return isinstance(task, str) and task in _BUILT_IN


def _parameter_count(fn: Any) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def _user_task(make_task: Callable[[TaskContext], Any], path: str) -> Callable[[TaskContext], Task]:
    def build(context: TaskContext) -> Task:
        task = make_task(context)
        if isinstance(task, Task):
            return task
        if isinstance(task, tuple) and len(task) in (3, 4) and all(callable(f) for f in task[:3]):
            return Task(*task)
        raise ConfigError(f"task={path!r} returned {type(task).__name__}, not a jm.Task(init_fn, step_fn, eval_fn).")
    return build


def _model_task(loss_fn: Callable, eval_metrics: Mapping[str, Reduction] | None,
                parts: tuple[str, ...] = ()) -> Callable[[TaskContext], Task]:
    """A task that trains `context.model` with `context.optimizer` on `loss_fn` of its
    predictions on `batch["x"]`; a `loss_fn` with a `pad_id` parameter (the "lm" task's)
    gets the config's `data.pad_id`. Its step's outputs add `grad_norm` (the gradients'
    global norm, before any clipping) and `learning_rate` (the rate of the step's update,
    from the `optimizer` section). With `optimizer.accumulate_steps` N, each step's
    batch is split into N micro-batches, scanned: the update takes their mean gradient,
    the outputs are their means, but for `parts` (the sums a metric divides), summed."""

    def build(context: TaskContext) -> Task:
        model, tx = context.model, context.optimizer
        if model is None or tx is None:
            raise ConfigError("This task trains a model: the config needs a model section (its name) and an "
                              "optimizer section.")
        loss_of = loss_fn
        if _takes(loss_fn, "pad_id"):
            loss_of = functools.partial(loss_fn, pad_id=pad_id(context.config))
        rate = learning_rate_of(context.config.get("optimizer"))
        micro = accumulate_steps(context.config)
        x = context.example_batch["x"][:1]
        seed, impl = context.seed, prng_impl(context.config)

        @jax.jit
        def init_fn() -> TrainState:  # one program, made once: the model's and the optimizer's init together
            params = nn.meta.unbox(model.init(jax.random.key(seed, impl=impl), x)["params"])
            return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

        def evaluate(state: TrainState, params: Any, batch: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
            return loss_of(state.apply_fn({"params": params}, batch["x"]), batch)

        def gradients(state: TrainState, batch: Mapping[str, Any]) -> tuple[Any, Any, Any]:
            (loss, metrics), grads = jax.value_and_grad(lambda p: evaluate(state, p, batch),
                                                        has_aux=True)(state.params)
            return loss, metrics, grads

        def step_fn(state: TrainState, batch: Mapping[str, Any]):
            if micro == 1:
                loss, metrics, grads = gradients(state, batch)
            else:  # the batch's micro-batches one after another, their sums carried: one update
                split = jax.tree.map(lambda x: x.reshape(micro, x.shape[0] // micro, *x.shape[1:]), batch)
                first = gradients(state, jax.tree.map(lambda x: x[0], split))

                def add(total, one):
                    return jax.tree.map(jnp.add, total, gradients(state, one)), None

                (loss, metrics, grads), _ = jax.lax.scan(add, first, jax.tree.map(lambda x: x[1:], split))
                loss, grads = loss / micro, jax.tree.map(lambda g: g / micro, grads)
                metrics = {name: value if name in parts else value / micro for name, value in metrics.items()}
            outputs = {"loss": loss, **metrics, "grad_norm": optax.tree.norm(grads)}
            if rate is not None:
                outputs["learning_rate"] = rate(state.step)  # a step is one update, micro-batches or not
            return state.apply_gradients(grads=grads), outputs

        def eval_fn(state: TrainState, batch: Mapping[str, Any]) -> dict[str, Any]:
            loss, metrics = evaluate(state, state.params, batch)
            return {"loss": loss, **metrics}

        return Task(init_fn, step_fn, eval_fn, eval_metrics)

    return build


def accumulate_steps(config: Mapping[str, Any]) -> int:
    """The config's `optimizer.accumulate_steps` (default 1): the micro-batches each step's
    batch of `data.batch_size` rows is split into, whose mean gradient makes its one
    update; every interval (steps, evaluations, checkpoints) counts these updates."""
    optimizer = config.get("optimizer") or {}
    value = optimizer.get("accumulate_steps", 1) if isinstance(optimizer, Mapping) else 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"optimizer.accumulate_steps={value!r}: give a number of micro-batches a step, >= 1.")
    rows = (config.get("data") or {}).get("batch_size")
    if value > 1 and isinstance(rows, int) and rows % value:
        raise ConfigError(f"optimizer.accumulate_steps={value} does not divide data.batch_size={rows}: each step's "
                          f"batch is split into that many micro-batches of equal size; give a divisor of {rows}.")
    return value


def pad_id(config: Mapping[str, Any]) -> int | None:
    """The config's `data.pad_id`: the token id that pads the targets, which counts for
    nothing in the loss and the metrics (None, the default: every id is a token)."""
    value = (config.get("data") or {}).get("pad_id")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError(f"data.pad_id={value!r}: give the token id that pads the targets (an int >= 0, 0 for "
                          "jaxmon.datasets:python_text), or None when every id is a token.")
    return value


def _takes(fn: Callable, name: str) -> bool:
    """Whether `fn` has a parameter `name`."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def boxed_params(context: TaskContext) -> Any:
    """The shapes of the model's parameters with their Flax logical-axis annotations
    (`nn.with_logical_partitioning`), or None for a task without a model."""
    if context.model is None:
        return None
    x = context.example_batch["x"][:1]
    key = jax.random.key(context.seed, impl=prng_impl(context.config))
    return jax.eval_shape(lambda: context.model.init(key, x)["params"])


#: The PRNG implementations a config's `prng_impl` names (JAX's), and the built-in
#: tasks' default: "rbg" (XLA's RngBitGenerator makes the bits, threefry splits the keys)
#: builds gpt2_small's state in two thirds of threefry's time, its keys split exactly as
#: threefry's, its values the same on any sharding; they differ across backends (a CPU
#: and a GPU initialise differently) and may across XLA versions. "threefry2x32", JAX's
#: default, gives the same values everywhere; "unsafe_rbg" splits keys with the bit
#: generator too (MaxText's default), a little faster still.
PRNG_IMPLS = ("rbg", "threefry2x32", "unsafe_rbg")


def prng_impl(config: Mapping[str, Any]) -> str:
    """The config's `prng_impl` (default "rbg"), checked; a `ConfigError` names a bad one."""
    impl = config.get("prng_impl", PRNG_IMPLS[0])
    if impl not in PRNG_IMPLS:
        raise ConfigError(f"prng_impl={impl!r} is not a PRNG JAX has: give one of {', '.join(map(repr, PRNG_IMPLS))} "
                          "(it makes the fresh state's random values; docs/cli.md, \"Start-up\").")
    return impl
