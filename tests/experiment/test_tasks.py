"""The built-in tasks: their fresh state is one program (the model's and the optimizer's
init together), compiled once however often it is called, from the PRNG a config's
`prng_impl` names (a bad name is a config error); the lm task's loss equals optax's and
its gradient keeps the logits in their own dtype."""

import logging

import jax
import jax.ad_checkpoint
import numpy as np
import optax
import pytest
from helpers import ROOT

import jaxmon as jm
from jaxmon._experiment import tasks
from jaxmon._experiment.parts import load_data
from jaxmon.models import Transformer

MODEL = {"vocab_size": 11, "max_len": 8, "num_layers": 1, "num_heads": 2, "embed_dim": 8, "mlp_dim": 16}


EXAMPLE = {"x": np.ones((4, 8), np.int32), "y": np.ones((4, 8), np.int32)}


def context(scan_layers=False, num_layers=1, **config):
    return tasks.TaskContext(config, Transformer(**{**MODEL, "num_layers": num_layers}, scan_layers=scan_layers),
                             optax.adamw(1e-3), 0, EXAMPLE, None)


def compiled(fn, caplog):
    """`fn()`'s state, and the names of the programs its call compiled."""
    caplog.clear()
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        state = jax.block_until_ready(fn())
    return state, [record.getMessage().split()[1] for record in caplog.records
                   if record.getMessage().startswith("Compiling ")]


@pytest.mark.parametrize("scan_layers", [False, True])
def test_the_fresh_state_is_one_program_and_a_second_call_compiles_nothing(scan_layers, caplog):
    init_fn = tasks.task_of("lm")(context(scan_layers)).init_fn
    first, programs = compiled(init_fn, caplog)
    assert programs == ["jit(init_fn)"]  # the parameters and the optimizer's state together, nothing eager
    assert isinstance(first, jm.TrainState) and int(first.step) == 0
    assert jax.tree.structure(first.opt_state) == jax.tree.structure(optax.adamw(1e-3).init(first.params))
    again, programs = compiled(init_fn, caplog)
    assert programs == []
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_scanned_layers_stack_one_block_s_parameters_on_a_layers_axis():
    state = tasks.task_of("lm")(context(scan_layers=True, num_layers=2)).init_fn()
    assert "block_0" not in state.params
    assert state.params["blocks"]["mlp_in"]["kernel"].shape == (2, 8, 16)  # (layers, embed, mlp)


def test_prng_impl_names_the_generator_of_the_fresh_state():
    states = {impl: tasks.task_of("lm")(context(prng_impl=impl)).init_fn() for impl in tasks.PRNG_IMPLS}
    kernels = {impl: np.asarray(state.params["block_0"]["mlp_in"]["kernel"]) for impl, state in states.items()}
    assert not np.array_equal(kernels["rbg"], kernels["threefry2x32"])
    default = tasks.task_of("lm")(context()).init_fn()  # no prng_impl: "rbg"
    np.testing.assert_array_equal(np.asarray(default.params["block_0"]["mlp_in"]["kernel"]), kernels["rbg"])
    with pytest.raises(jm.ConfigError, match=r"prng_impl='philox' is not a PRNG JAX has: give one of 'rbg', "
                                             r"'threefry2x32', 'unsafe_rbg'"):
        tasks.task_of("lm")(context(prng_impl="philox"))


# -- the lm task's loss --------------------------------------------------------------------------


def test_the_lm_loss_equals_optax_s_and_its_gradient_keeps_no_float32_copy_of_the_logits(capsys):
    rng = np.random.default_rng(0)
    logits = jax.numpy.asarray(rng.normal(size=(4, 8, 50)) * 3, jax.numpy.float32)
    targets = jax.numpy.asarray(rng.integers(0, 50, (4, 8)))
    weights = jax.numpy.asarray(rng.random((4, 8)), jax.numpy.float32)

    def ours(logits):
        return (tasks.cross_entropy(logits, targets) * weights).sum()

    def optax_s(logits):
        return (optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), targets) * weights).sum()

    np.testing.assert_allclose(float(ours(logits)), float(optax_s(logits)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(ours)(logits)), np.asarray(jax.grad(optax_s)(logits)), atol=1e-6)
    low = logits.astype(jax.numpy.bfloat16)  # a bfloat16 model's logits: the loss in float32, the gradient in theirs
    np.testing.assert_allclose(float(ours(low)), float(optax_s(low)), rtol=1e-6)
    assert jax.grad(ours)(low).dtype == jax.numpy.bfloat16
    jax.ad_checkpoint.print_saved_residuals(ours, low)
    kept = capsys.readouterr().out
    assert "bf16[4,8,50] from the argument" in kept and "f32[4,8,50]" not in kept  # optax's keeps f32[4,8,50]


def test_the_lm_task_masks_the_configs_pad_id_and_no_id_without_one():
    """A character vocabulary's id 0 (say '\\n') is a token unless data.pad_id says it pads."""
    batch = {"x": np.ones((2, 8), np.int32), "y": np.array([[0, 1, 2, 3, 0, 0, 4, 5], [6, 7, 0, 1, 2, 3, 4, 5]])}
    counted = {}
    for name, config in {"none": {}, "zero": {"data": {"pad_id": 0}}, "five": {"data": {"pad_id": 5}}}.items():
        task = tasks.task_of("lm")(context(**config))
        metrics = jax.jit(task.eval_fn)(task.init_fn(), batch)
        counted[name] = float(metrics["tokens"])
        assert float(metrics["loss"]) == pytest.approx(float(metrics["loss_sum"]) / counted[name], rel=1e-6)
    assert counted == {"none": 16.0, "zero": 12.0, "five": 14.0}


@pytest.mark.parametrize("value", [-1, "0", 1.5, True])
def test_a_pad_id_that_is_no_token_id_is_a_config_error_naming_it(value):
    with pytest.raises(jm.ConfigError, match=rf"data.pad_id={value!r}: give the token id that pads the targets"):
        tasks.task_of("lm")(context(data={"pad_id": value}))


def test_the_lm_configs_pad_id_reaches_the_task_and_not_the_data_source():
    config = jm.load_config(ROOT / "configs" / "lm.py")
    assert config["data"]["pad_id"] == 0 and tasks.pad_id(config) == 0
    data = load_data(config)  # python_text takes no pad_id: the key is the task's
    assert data.example["y"].dtype == np.int32


def test_a_built_in_tasks_step_outputs_its_gradient_norm_and_the_rate_of_its_update():
    schedule = {"name": "linear_schedule", "init_value": 0.0, "end_value": 0.4, "transition_steps": 4}
    config = {"optimizer": {"name": "adamw", "learning_rate": schedule, "clip_global_norm": 0.01}}
    tx = optax.chain(optax.clip_by_global_norm(0.01), optax.adamw(optax.linear_schedule(0.0, 0.4, 4)))
    task = tasks.task_of("lm")(tasks.TaskContext(config, Transformer(**MODEL), tx, 0, EXAMPLE, None))
    state, step = task.init_fn(), jax.jit(task.step_fn)
    gradients = jax.jit(jax.grad(lambda params, state, batch: task.eval_fn(state.replace(params=params),
                                                                           batch)["loss"]))
    batch = {"x": np.ones((4, 8), np.int32), "y": np.full((4, 8), 3, np.int32)}
    rates = []
    for _ in range(3):
        grads = gradients(state.params, state, batch)
        state, outputs = step(state, batch)
        rates.append(float(outputs["learning_rate"]))
        assert float(outputs["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)
        assert float(outputs["grad_norm"]) > 0.01  # the norm before clipping
    assert rates == pytest.approx([0.0, 0.1, 0.2])  # the rate each update used: the schedule at 0, 1, 2


def test_with_accumulation_the_rate_counts_updates_not_micro_batches():
    config = {"data": {"batch_size": 4}, "optimizer": {
        "name": "sgd", "accumulate_steps": 2,
        "learning_rate": {"name": "linear_schedule", "init_value": 0.0, "end_value": 0.4, "transition_steps": 4}}}
    tx = optax.sgd(optax.linear_schedule(0.0, 0.4, 4))
    task = tasks.task_of("lm")(tasks.TaskContext(config, Transformer(**MODEL), tx, 0, EXAMPLE, None))
    state, step = task.init_fn(), jax.jit(task.step_fn)
    rates = []
    for _ in range(5):  # each step: 2 micro-batches of 2 rows, one update
        state, outputs = step(state, {"x": np.ones((4, 8), np.int32), "y": np.ones((4, 8), np.int32)})
        rates.append(float(outputs["learning_rate"]))
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_a_constant_rate_is_output_as_it_is():
    task = tasks.task_of("lm")(tasks.TaskContext({"optimizer": {"name": "sgd", "learning_rate": 0.05}},
                                                 Transformer(**MODEL), optax.sgd(0.05), 0, EXAMPLE, None))
    _, outputs = jax.jit(task.step_fn)(task.init_fn(), {"x": np.ones((4, 8), np.int32),
                                                        "y": np.ones((4, 8), np.int32)})
    assert float(outputs["learning_rate"]) == pytest.approx(0.05) and float(outputs["grad_norm"]) > 0


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_accumulating_4_micro_batches_of_a_32_row_batch_is_one_step_on_the_32_rows(task):
    """nanoGPT's and MaxText's gradient accumulation: one update a step, from the mean
    gradient of its micro-batches; the step's outputs are those of the whole batch (the lm
    task's sums summed)."""
    rng = np.random.default_rng(0)
    if task == "lm":
        batch = {"x": rng.integers(0, 11, (32, 8)).astype(np.int32), "y": rng.integers(0, 11, (32, 8)).astype(np.int32)}
        model = Transformer(**MODEL)
    else:
        batch = {"x": rng.normal(size=(32, 8)).astype(np.float32), "y": rng.integers(0, 3, 32).astype(np.int32)}
        model = jm.models.MLP(features=[16, 3])
    schedule = {"name": "linear_schedule", "init_value": 0.01, "end_value": 0.0, "transition_steps": 10}
    built = {}
    for micro in (1, 4):
        config = {"data": {"batch_size": 32}, "optimizer": {"name": "adamw", "learning_rate": schedule,
                                                             "accumulate_steps": micro}}
        tx = optax.adamw(optax.linear_schedule(0.01, 0.0, 10))
        step = tasks.task_of(task)(tasks.TaskContext(config, model, tx, 0, {k: v[:2] for k, v in batch.items()},
                                                     None))
        state = step.init_fn()
        for _ in range(2):
            state, outputs = jax.jit(step.step_fn)(state, batch)
        built[micro] = state, outputs
    (one, whole), (four, parts) = built[1], built[4]
    assert int(four.step) == int(one.step) == 2  # one update a step, micro-batches or not
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(four.params), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-5, atol=2e-6)
    assert set(parts) == set(whole)
    for name in whole:
        np.testing.assert_allclose(float(parts[name]), float(whole[name]), rtol=2e-5, atol=1e-6, err_msg=name)


def test_accumulate_steps_must_divide_the_batch():
    config = {"data": {"batch_size": 30},
              "optimizer": {"name": "adamw", "learning_rate": 0.1, "accumulate_steps": 4}}
    with pytest.raises(jm.ConfigError, match=r"accumulate_steps=4 does not divide data.batch_size=30: .* of 30"):
        tasks.task_of("lm")(tasks.TaskContext(config, Transformer(**MODEL), optax.adamw(0.1), 0, EXAMPLE, None))
