"""`benchmarks/profile_top_ops.py`: the ops that take a step's device time, read from a
trace taken on this CPU and from traces shaped as a GPU's. The script's own capture of a
tiny gpt2_small is the small GPU check's profile part (tests/test_gpu_check.py)."""

import jax
import jax.numpy as jnp
import pytest
from helpers import load_benchmark

profile_top_ops = load_benchmark("profile_top_ops")


def span(pid, tid, name, ts, dur, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur, "args": args}


def names(pid, process, threads):
    return [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process}}] + [
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
        for tid, name in threads.items()]


def test_the_top_ops_of_a_trace_taken_on_this_cpu_are_the_programs_ops(tmp_path):
    @jax.jit
    def program(x):
        return jnp.tanh(x @ x).sum(0) + jnp.sin(x).mean()

    x = jnp.ones((256, 256))
    program(x).block_until_ready()
    with profile_top_ops.tracing(str(tmp_path)):
        for _ in range(3):
            y = program(x)
        y.block_until_ready()
    path = profile_top_ops.find_trace(tmp_path)
    assert path.name.endswith(".trace.json.gz")
    profile = profile_top_ops.top_ops(profile_top_ops.load_trace(path))
    assert "host" in profile.source and profile.total_us > 0
    ours = [op for op in profile.ops if op.module == "jit_program"]
    assert ours and all(op.count == 3 for op in ours)  # each op once a call
    assert sum(profile.percent(op) for op in profile.ops) == pytest.approx(100)
    # The same events read from the xplane.pb, as where no JSON is written.
    [xplane] = path.parent.glob("*.xplane.pb")
    again = profile_top_ops.top_ops(profile_top_ops.load_trace(xplane))
    assert [op.name for op in again.ops[:3]] == [op.name for op in profile.ops[:3]]
    assert again.total_us == pytest.approx(profile.total_us, rel=1e-3)


def gpu_trace(streams: bool = True) -> dict:
    events = names(1, "/host:CPU", {10: "python"}) + names(2, "/device:GPU:0", {
        1: "Stream #13(Compute)", 2: "Stream #14(Compute)", 3: "XLA Ops", 4: "XLA Modules"})
    events.append(span(1, 10, "launch", 0, 50, hlo_op="fusion.1", hlo_module="jit_step"))  # the host's launch
    if streams:
        events += [span(2, 1, "loop_fusion_1", 100, 300, hlo_op="fusion.1", hlo_module="jit_step"),
                   span(2, 1, "loop_fusion_1", 900, 300, hlo_op="fusion.1", hlo_module="jit_step"),
                   span(2, 2, "sm90_gemm_bf16", 100, 500, hlo_op="custom-call.2", hlo_module="jit_step")]
    events += [span(2, 3, "fusion.1", 100, 1100, hlo_module="jit_step"),
               span(2, 3, "custom-call.2", 100, 500, hlo_module="jit_step"),
               span(2, 4, "jit_step", 100, 1100)]
    return {"traceEvents": events}


def test_on_a_gpu_the_streams_kernels_count_grouped_by_their_xla_op():
    profile = profile_top_ops.top_ops(gpu_trace())
    assert "stream" in profile.source and profile.total_us == 1100
    [fusion, gemm] = profile.ops
    assert (fusion.name, fusion.us, fusion.count, fusion.kernel) == ("fusion.1", 600, 2, "loop_fusion_1")
    assert (gemm.name, gemm.kernel, round(profile.percent(gemm), 1)) == ("custom-call.2", "sm90_gemm_bf16", 45.5)


def test_without_stream_events_the_devices_xla_ops_line_counts():
    profile = profile_top_ops.top_ops(gpu_trace(streams=False))
    # The line's custom-call.2 runs inside fusion.1's span: each counts its own time.
    assert "XLA Ops" in profile.source
    assert [(op.name, op.us) for op in profile.ops] == [("fusion.1", 600), ("custom-call.2", 500)]


def test_a_gpu_trace_without_device_events_says_its_figures_are_the_hosts():
    events = names(1, "/host:CPU", {10: "python"}) + names(2, "/device:GPU:0", {1: "Stream #13(Compute)"})
    events.append(span(1, 10, "launch", 0, 50, hlo_op="fusion.1", hlo_module="jit_step"))
    profile = profile_top_ops.top_ops({"traceEvents": events})
    assert profile.source.startswith("no device events recorded") and profile.ops[0].us == 50


def test_nested_events_count_their_own_time_once():
    events = names(1, "/host:CPU", {7: "worker"}) + [
        span(1, 7, "while.1", 0, 1000, hlo_op="while.1"), span(1, 7, "dot.2", 100, 300, hlo_op="dot.2"),
        span(1, 7, "add.3", 500, 200, hlo_op="add.3"), span(1, 7, "ThreadpoolListener::Record", 10, 0)]
    profile = profile_top_ops.top_ops(events)
    assert {op.name: op.us for op in profile.ops} == {"while.1": 500, "dot.2": 300, "add.3": 200}


def test_a_trace_without_op_events_is_refused_naming_its_processes():
    with pytest.raises(ValueError, match=r"no event of an XLA op \(its processes: \['/host:CPU'\]\)"):
        profile_top_ops.top_ops(names(1, "/host:CPU", {1: "python"}) + [span(1, 1, "PjitFunction", 0, 5)])


def test_a_directory_without_a_trace_is_refused_naming_what_it_holds(tmp_path):
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"no \*\.trace\.json\.gz.*'notes\.txt'"):
        profile_top_ops.find_trace(tmp_path)
