"""TensorBoard event files as TFRecords: an `EventFile` appended to and read back by
TensorBoard's reader, `cut_after` cutting a file back to a step (and a record a kill cut
short), and which event files a directory and this process hold."""

import os

from helpers import event_scalars, read_events
from tensorboardX.proto import event_pb2, summary_pb2

from jaxmon._writers.events import EventFile, cut_after, event_files, open_paths


def scalar_event(step, value, tag="loss"):
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])
    return event_pb2.Event(wall_time=1.0, step=step, summary=summary)


def file_of_steps(logdir, steps, suffix=".test"):
    """An event file in `logdir` of one scalar "loss" = 10 * step for each of `steps`; its path."""
    events = EventFile(str(logdir), suffix)
    for step in steps:
        events.write(scalar_event(step, 10.0 * step))
    events.close()
    return events.path


def records(path):
    """The events of the file at `path`, parsed."""
    from jaxmon._writers.events import _spans

    with open(path, "rb") as file:
        return [event_pb2.Event.FromString(data) for _, _, data in _spans(file)]


def test_an_event_file_starts_with_its_version_and_is_read_by_tensorboard(tmp_path):
    events = EventFile(str(tmp_path), ".7.0")
    assert os.path.basename(events.path).startswith("events.out.tfevents.") and events.path.endswith(".7.0")
    assert os.path.realpath(events.path) in open_paths()
    events.write(scalar_event(1, 0.5))
    events.flush()
    assert event_scalars(read_events(tmp_path), "loss") == [(1, 0.5)]  # flushed: readable while open
    events.close()
    assert os.path.realpath(events.path) not in open_paths()
    assert records(events.path)[0].file_version == "brain.Event:2"


def test_cut_after_drops_the_events_after_the_step_and_keeps_the_version(tmp_path):
    path = file_of_steps(tmp_path, range(1, 11))
    assert cut_after(path, 4)
    assert event_scalars(read_events(tmp_path), "loss") == [(s, 10.0 * s) for s in range(1, 5)]
    assert records(path)[0].file_version == "brain.Event:2"
    assert not cut_after(path, 4) and not cut_after(path, 100)  # nothing after the step: the file as it was
    assert [name for name in os.listdir(tmp_path) if name.endswith(".tmp")] == []


def test_cut_after_drops_a_last_record_a_kill_cut_short(tmp_path):
    path = file_of_steps(tmp_path, [1, 2, 3])
    whole = os.path.getsize(path)
    with open(path, "r+b") as file:
        file.truncate(whole - 5)  # step 3's record, cut short
    assert cut_after(path, 100)
    assert [event.step for event in records(path)] == [0, 1, 2]
    assert event_scalars(read_events(tmp_path), "loss") == [(1, 10.0), (2, 20.0)]


def test_a_file_without_one_readable_record_is_left_alone(tmp_path):
    path = tmp_path / "events.out.tfevents.1.host"
    path.write_bytes(b"not an event file")
    assert not cut_after(str(path), 0)
    assert path.read_bytes() == b"not an event file"


def test_event_files_are_the_files_of_the_directory_named_as_tensorboard_reads_them(tmp_path):
    path = file_of_steps(tmp_path, [1])
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "old.tfevents.dir").mkdir()  # a directory, not a file
    (tmp_path / "sub").mkdir()
    file_of_steps(tmp_path / "sub", [1])  # not directly in the directory
    assert event_files(str(tmp_path)) == [path]
    assert event_files(str(tmp_path / "missing")) == []
