"""docs/migration.md: its name tables resolve against jaxmon and cover the API contract and
TF 1.x's names; its jaxmon scripts run and print (and write) what the guide says."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import cpu_env

import jaxmon as jm

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "migration.md"

# The contract (API.md), copied here because tests run from a clean clone.
CORE = ("Hook", "SessionRunHook", "RunArgs", "SessionRunArgs", "RunContext", "SessionRunContext", "RunValues",
        "SessionRunValues", "MonitoredSession", "MonitoredTrainingSession")
BUILT_IN_HOOKS = ("StopAtStepHook", "CheckpointSaverHook", "CheckpointSaverListener", "StepCounterHook", "LoggingHook",
                  "LoggingTensorHook", "NanHook", "NanTensorHook", "SummarySaverHook", "FeedFnHook", "FinalOpsHook",
                  "GlobalStepWaiterHook", "ProfilerHook", "EarlyStoppingHook", "EvalHook", "ProgressBarHook",
                  "PeriodicHook")
TF_ALIASES = {"SessionRunHook": "Hook", "SessionRunArgs": "RunArgs", "SessionRunContext": "RunContext",
              "SessionRunValues": "RunValues", "LoggingTensorHook": "LoggingHook", "NanTensorHook": "NanHook"}

# TF 1.x names the migration guide must map: the session and its parts, the hook protocol, errors,
# the basic hooks, MonitoredTrainingSession and Supervisor.
TF_NAMES = (
    # MonitoredSession and its parts
    "MonitoredSession", "SingularMonitoredSession", "raw_session", "_RecoverableSession", "_CoordinatedSession",
    "_HookedSession", "ChiefSessionCreator", "WorkerSessionCreator", "checkpoint_filename_with_path",
    "SessionManager", "prepare_session", "wait_for_session", "Scaffold", "finalize", "init_op", "init_feed_dict",
    "init_fn", "ready_op", "ready_for_local_init_op", "local_init_op", "local_init_feed_dict", "summary_op", "saver",
    "Coordinator", "start_queue_runners", "QUEUE_RUNNERS", "run_step_fn", "StepContext", "stop_grace_period_secs",
    "RunOptions", "RunMetadata",
    # the hook protocol
    "SessionRunHook", "begin", "after_create_session", "before_run", "after_run", "end", "SessionRunArgs",
    "SessionRunContext", "SessionRunValues",
    # errors
    "OutOfRangeError", "AbortedError", "UnavailableError", "DeadlineExceededError", "UnknownError", "CancelledError",
    "NanLossDuringTrainingError",
    # basic_session_run_hooks
    "get_or_create_global_step", "SecondOrStepTimer", "NeverTriggerTimer", "StopAtStepHook",
    "_MultiStepStopAtStepHook", "CheckpointSaverHook", "CheckpointSaverListener", "checkpoint_basename",
    "save_graph_def", "StepCounterHook", "LoggingTensorHook", "NanTensorHook", "SummarySaverHook",
    "GlobalStepWaiterHook", "FinalOpsHook", "FeedFnHook", "ProfilerHook", "SummaryWriterCache", "SessionLog",
    # MonitoredTrainingSession
    "MonitoredTrainingSession", "master", "is_chief", "checkpoint_dir", "scaffold", "hooks", "chief_only_hooks",
    "save_checkpoint_secs", "save_checkpoint_steps", "save_summaries_steps", "save_summaries_secs", "config",
    "log_step_count_steps", "max_wait_secs", "summary_dir", "USE_DEFAULT",
    # Supervisor and the Coordinator passthroughs
    "Supervisor", "managed_session", "prepare_or_wait_for_session", "start_standard_services", "SVSummaryThread",
    "SVStepCounterThread", "SVTimerCheckpointThread", "loop", "LooperThread", "summary_computed", "request_stop",
    "should_stop", "stop_on_exception", "wait_for_stop", "coord", "stop", "join", "clean_stop_exception_types",
    "logdir", "save_model_secs", "recovery_wait_secs", "stop_grace_secs", "session_manager", "summary_writer",
    "global_step", "local_init_run_options", "graph", "save_path",
)

JM_NAME = re.compile(r"\bjm\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)")
HEADER = ["TF 1.x", "jaxmon", "notes"]


def guide() -> str:
    return GUIDE.read_text(encoding="utf-8")


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def table_rows(text: str) -> list[list[str]]:
    """The rows of every `| TF 1.x | jaxmon | notes |` table, header and rule left out."""
    rows, in_table = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
        elif cells(line) == HEADER:
            in_table = True
        elif in_table and not set(line) <= set("|-: "):
            rows.append(cells(line))
    return rows


def jm_names(text: str) -> list[str]:
    return JM_NAME.findall(text)


def resolves(dotted: str) -> bool:
    obj = jm
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def code_blocks(text: str) -> list[tuple[str, str, int]]:
    """(info string, code, line number) of every fenced block, in order."""
    blocks, info, start, lines = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if info is None and line.startswith("```"):
            info, start, lines = line[3:].strip(), number, []
        elif info is not None and line.startswith("```"):
            blocks.append((info, "\n".join(lines) + "\n", start))
            info = None
        elif info is not None:
            lines.append(line)
    assert info is None, f"unclosed code block at line {start}"
    return blocks


def scripts(text: str) -> list[tuple[str, str, str]]:
    """(id, script, expected stdout) of every runnable block.

    ```python jaxmon-run blocks are complete scripts. A ```python jaxmon-run-variant
    block replaces the previous script from the line equal to its own first line on.
    Each must be followed by a ```text block: exactly what it prints.
    """
    blocks = code_blocks(text)
    found, previous = [], None
    for i, (info, code, line) in enumerate(blocks):
        if info not in ("python jaxmon-run", "python jaxmon-run-variant"):
            continue
        if info.endswith("variant"):
            assert previous is not None, f"line {line}: a variant needs a jaxmon-run block before it"
            first = code.splitlines()[0]
            base = previous.splitlines(keepends=True)
            assert first + "\n" in base, f"line {line}: {first!r} is not a line of the script it varies"
            code = "".join(base[:base.index(first + "\n")]) + code
        else:
            previous = code
        assert i + 1 < len(blocks) and blocks[i + 1][0] == "text", f"line {line}: no ```text output block after it"
        found.append((f"line{line}", code, blocks[i + 1][1]))
    return found


def run_script(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**cpu_env(), "PYTHONPATH": path}
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# -- the tables ----------------------------------------------------------------------------------


def test_the_tables_have_three_filled_columns():
    rows = table_rows(guide())
    assert len(rows) > 90
    for row in rows:
        assert len(row) == 3 and all(row), row
        tf, jaxmon, _ = row
        # A jaxmon cell names jaxmon objects, or says there is none (and the notes say what to do).
        assert jaxmon == "—" or jm_names(jaxmon), row


def test_every_jaxmon_name_in_the_tables_is_an_attribute_of_jaxmon():
    names = [name for row in table_rows(guide()) for name in jm_names(row[1])]
    assert len(set(names)) > 50
    assert [name for name in names if not resolves(name)] == []


def test_every_jm_name_anywhere_in_the_guide_resolves():
    names = jm_names(guide())
    assert [name for name in names if not resolves(name)] == []


def test_tf_aliases_are_the_jaxmon_objects_and_share_a_row():
    rows = table_rows(guide())
    for tf_name, name in TF_ALIASES.items():
        assert getattr(jm, tf_name) is getattr(jm, name), tf_name
        assert any({tf_name, name} <= set(jm_names(row[1])) and tf_name in row[0] for row in rows), tf_name


def test_the_tables_cover_the_api_contract():
    named = {name.split(".")[0] for row in table_rows(guide()) for name in jm_names(row[1])}
    assert [name for name in CORE + BUILT_IN_HOOKS if name not in named] == []


def test_the_tables_cover_every_listed_tf_name():
    tf_column = "\n".join(row[0] for row in table_rows(guide()))
    assert [name for name in TF_NAMES if not re.search(rf"(?<!\w){re.escape(name)}(?!\w)", tf_column)] == []


# -- the code ------------------------------------------------------------------------------------


def test_every_python_block_is_valid_python():
    blocks = [(code, line) for info, code, line in code_blocks(guide()) if info.startswith("python")]
    assert len(blocks) >= 5
    for code, line in blocks:
        compile(code, f"migration.md:{line}", "exec")


SCRIPTS = scripts(guide())
TRAINING = [script for script in SCRIPTS if '"runs/linear"' in script[1]]
OTHERS = [script for script in SCRIPTS if script not in TRAINING]


def test_the_guide_has_its_runnable_scripts():
    assert len(TRAINING) == 2 and len(OTHERS) >= 3
    assert "jm.MonitoredTrainingSession(" in TRAINING[0][1] and "jm.MonitoredSession(" in TRAINING[1][1]


@pytest.mark.parametrize("code, expected", [script[1:] for script in OTHERS], ids=[s[0] for s in OTHERS])
def test_each_behaviour_script_prints_what_the_guide_shows(code, expected, tmp_path):
    assert run_script(code, tmp_path).stdout == expected


def check_trained(run_dir: pathlib.Path, stderr: str) -> None:
    """The after script's artefacts: checkpoints 600..1000, a trained state, summaries, logs."""
    assert jm.latest_checkpoint_step(run_dir) == 1000
    assert sorted(int(name) for name in os.listdir(run_dir) if name.isdigit()) == [600, 700, 800, 900, 1000]
    state, step, meta = jm.restore_checkpoint(run_dir)
    assert step == meta["step"] == 1000
    np.testing.assert_allclose(np.ravel(state["params"]["w"]), [1.0, -2.0, 0.5], atol=0.05)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, *range(100, 1001, 100)]  # step 1, then every 100
    assert [r["step"] for r in records if "global_step/sec" in r] == list(range(100, 1001, 100))
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))
    logged = re.findall(r"loss = [-\d.e]+, w_norm = ([\d.]+)", stderr)
    assert len(logged) == 11 and abs(float(logged[-1]) - np.sqrt(5.25)) < 0.05  # steps 1, 100, ..., 1000


def test_the_monitored_training_session_script_trains_checkpoints_and_resumes(tmp_path):
    _, code, expected = TRAINING[0]
    first = run_script(code, tmp_path)
    assert first.stdout == expected == "stopped at step 1000\n"
    run_dir = tmp_path / "runs" / "linear"
    check_trained(run_dir, first.stderr)
    lines = (run_dir / "metrics.jsonl").read_text()
    again = run_script(code, tmp_path)  # restores step 1000 and stops before its first run
    assert again.stdout == expected
    assert (run_dir / "metrics.jsonl").read_text() == lines
    assert jm.latest_checkpoint_step(run_dir) == 1000


def test_the_spelled_out_monitored_session_script_does_the_same(tmp_path):
    _, code, expected = TRAINING[1]
    result = run_script(code, tmp_path)
    assert result.stdout == expected == "stopped at step 1000\n"
    check_trained(tmp_path / "runs" / "linear", result.stderr)


def test_the_architecture_page_names_every_module_and_only_real_ones():
    page = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(_[a-z_]+/[a-z_]+\.py)`", page))  # a path below jaxmon/: `_run/session.py`
    modules = {f"{path.parent.name}/{path.name}" for path in (ROOT / "jaxmon").glob("_*/*.py")
               if path.name != "__init__.py"}
    assert named - modules == set(), "named but missing"
    assert modules - named == set(), "not on the page"
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
