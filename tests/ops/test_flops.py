"""A step's FLOPs (`step_flops`): XLA's count with every loop counted by its trip count,
against the same step unrolled; while loops, and a scan whose body does not lower alone,
counted once and said; a platform whose XLA gives no count has the step counted lowered
for the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxmon._ops.flops import StepFlops, step_flops

PARAMS = {"a": jnp.ones((64, 128)), "b": jnp.ones((128, 16))}
BATCH = {"x": np.ones((4, 8, 64), np.float32)}  # 4 micro-batches of 8 rows


def loss(params, x):
    return jnp.mean((jnp.tanh(x @ params["a"]) @ params["b"]) ** 2)


def update(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g / 4, params, grads), {}


def add(grads, x):
    return jax.tree.map(jnp.add, grads, jax.grad(loss)(PARAMS, x))


def zeros():
    return jax.tree.map(jnp.zeros_like, PARAMS)


def unrolled(params, batch):
    grads = zeros()
    for i in range(4):
        grads = add(grads, batch["x"][i])
    return update(params, grads)


def scanned(params, batch):
    grads, _ = jax.lax.scan(lambda g, x: (add(g, x), None), zeros(), batch["x"])
    return update(params, grads)


def nested(params, batch):  # 2 scans of 2 micro-batches, in a scan of 2
    def outer(grads, xs):
        return jax.lax.scan(lambda g, x: (add(g, x), None), grads, xs)[0], None

    grads, _ = jax.lax.scan(outer, zeros(), batch["x"].reshape(2, 2, 8, 64))
    return update(params, grads)


def fori(params, batch):  # static bounds: a scan
    return update(params, jax.lax.fori_loop(0, 4, lambda i, g: add(g, batch["x"][i]), zeros()))


def test_the_unrolled_step_is_xlas_own_count():
    xla = jax.jit(unrolled).lower(PARAMS, BATCH).cost_analysis()
    if xla is None:
        pytest.skip(f"XLA gives no count before compiling on {jax.default_backend()}")
    assert step_flops(unrolled, PARAMS, BATCH) == StepFlops(xla["flops"], jax.default_backend())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (PARAMS, BATCH))
    assert step_flops(unrolled, *abstract).flops == xla["flops"]  # the session counts on shapes


@pytest.mark.parametrize("step", [scanned, nested, fori], ids=["scan", "nested scans", "fori_loop"])
def test_a_loop_of_micro_batches_counts_as_the_same_step_unrolled(step):
    full = step_flops(unrolled, PARAMS, BATCH).flops
    counted = step_flops(step, PARAMS, BATCH)
    assert counted.flops == pytest.approx(full, rel=0.05) and counted.counted_once == 0
    if step is scanned and jax.default_backend() == "cpu":  # what XLA alone says: the body once
        assert jax.jit(step).lower(PARAMS, BATCH).cost_analysis()["flops"] < 0.3 * full


def test_a_loop_in_a_branch_of_a_cond_counts_by_its_trip_count():
    def step(params, batch):
        return jax.lax.cond(batch["x"].sum() > 0, lambda: scanned(params, batch), lambda: update(params, zeros()))

    assert step_flops(step, PARAMS, BATCH).flops == pytest.approx(step_flops(unrolled, PARAMS, BATCH).flops, rel=0.05)


def test_a_while_loop_is_counted_once_and_the_count_says_so():
    def step(params, batch):
        def body(carry):
            i, grads = carry
            return i + 1, add(grads, batch["x"][i])
        return update(params, jax.lax.while_loop(lambda carry: carry[0] < 4, body, (0, zeros()))[1])

    counted = step_flops(step, PARAMS, BATCH)
    assert counted.counted_once == 1
    assert counted.flops == pytest.approx(step_flops(unrolled, PARAMS, BATCH).flops / 4, rel=0.1)


def test_a_scan_whose_body_does_not_lower_alone_keeps_xlas_count_and_the_count_says_so():
    mesh = jax.make_mesh((1,), ("d",))

    def step(w, x):
        def local(w, x):  # the body's psum names the shard_map's axis: it lowers only inside it
            return jax.lax.scan(lambda h, _: (h @ w + jax.lax.psum(h.sum(), "d"), None), x, None, length=4)[0]
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P()), out_specs=P())(w, x), {}

    counted = step_flops(step, jnp.ones((8, 8)), jnp.ones((4, 8)))
    assert counted.counted_once == 1 and 2 * 4 * 8 * 8 <= counted.flops < 2 * 2 * 4 * 8 * 8  # one matmul's worth


def test_where_the_platform_gives_no_count_the_step_lowered_for_the_cpu_is_counted(monkeypatch):
    """A GPU's PJRT plugin gives no count before compiling: on a CPU, a platform that gives
    none, except for a lowering on the default device the count sets (the CPU's)."""
    analysis = jax.stages.Lowered.cost_analysis
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis",
                        lambda self: analysis(self) if jax.config.jax_default_device is not None else None)
    counted = step_flops(scanned, PARAMS, BATCH)
    monkeypatch.undo()
    assert counted.platform == "cpu" and counted.flops == step_flops(scanned, PARAMS, BATCH).flops


def test_where_no_lowering_has_a_count_the_count_says_why(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    assert step_flops(scanned, PARAMS, BATCH) == StepFlops(
        None, "gpu", why="XLA gives no count of it on gpu nor lowered for the CPU")
