"""TensorBoardWriter: every kind of summary and the hyper-parameters written as event
files, read back by TensorBoard's own reader."""

import os

import numpy as np
import pytest
from helpers import event_files, event_scalars, read_events

import jaxmon as jm


def test_scalars_histograms_images_and_texts_are_read_back_at_their_steps(tmp_path):
    writer = jm.TensorBoardWriter(tmp_path / "board")  # made if missing
    writer.write_scalars(1, {"loss": np.float32(0.5), "acc": 1})
    writer.write_histograms(2, {"w": np.arange(4.0).reshape(2, 2)})
    writer.write_images(2, {"gray": np.zeros((4, 6)), "rgb": np.ones((4, 6, 3)), "batch": np.ones((2, 4, 6, 1))})
    writer.write_texts(3, {"note": 42})
    writer.close()
    acc = read_events(tmp_path / "board")
    assert event_scalars(acc, "loss") == [(1, 0.5)] and event_scalars(acc, "acc") == [(1, 1.0)]
    [histogram] = acc.Histograms("w")
    assert (histogram.step, histogram.histogram_value.num, histogram.histogram_value.sum) == (2, 4, 6.0)
    assert [(e.step, e.width, e.height) for e in acc.Images("gray")] == [(2, 6, 4)]
    assert [(e.step, e.width, e.height) for e in acc.Images("rgb")] == [(2, 6, 4)]
    assert sorted(acc.Tags()["images"]) == ["batch", "gray", "rgb"]
    assert [e.step for e in acc.Images("batch")] == [2]  # NHWC: the batch as one image
    [text] = acc.Tensors("note/text_summary")
    assert (text.step, text.tensor_proto.string_val[0].decode()) == (3, "42")


@pytest.mark.parametrize("shape", [(4,), (4, 6, 2), (1, 2, 4, 6, 3)], ids=["1d", "2-channels", "5d"])
def test_an_image_that_is_not_hw_hwc_or_nhwc_of_1_3_or_4_channels_is_a_value_error(tmp_path, shape):
    writer = jm.TensorBoardWriter(tmp_path)
    try:
        with pytest.raises(ValueError, match=rf"Image summary 'img' has shape {re_shape(shape)}; images are HW"):
            writer.write_images(1, {"img": np.zeros(shape)})
    finally:
        writer.close()


def re_shape(shape):
    return str(shape).replace("(", r"\(").replace(")", r"\)")


def test_hyper_parameters_go_to_the_hparams_dashboard_and_as_a_table_to_the_text_one(tmp_path):
    writer = jm.TensorBoardWriter(tmp_path)
    writer.write_hparams({"lr": 0.1, "model": {"width": 64}})
    writer.close()
    acc = read_events(tmp_path)
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")
    [table] = acc.Tensors("hparams/text_summary")
    assert table.step == 0
    lines = ["| name | value |", "|---|---|", "| lr | 0.1 |", "| model.width | 64 |"]
    assert table.tensor_proto.string_val[0].decode() == "\n".join(lines)


def test_two_writers_of_one_directory_opened_in_one_second_write_two_files(tmp_path):
    first, second = jm.TensorBoardWriter(tmp_path), jm.TensorBoardWriter(tmp_path)
    first.write_scalars(1, {"loss": 1.0})
    second.write_scalars(2, {"loss": 2.0})
    first.close()
    second.close()
    assert len(event_files(tmp_path)) == 2
    assert all(f".{os.getpid()}." in name for name in event_files(tmp_path))
    assert sorted(event_scalars(read_events(tmp_path), "loss")) == [(1, 1.0), (2, 2.0)]


def test_a_restart_marks_the_step_run_again_once_however_many_hooks_restart_the_writer(tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    writer = jm.TensorBoardWriter(tmp_path)
    writer.write_scalars(5, {"loss": 5.0})
    writer.restart(3)
    writer.restart(3)  # a writer shared by several hooks is restarted by each
    writer.write_scalars(4, {"loss": 4.0})
    writer.close()
    [name] = event_files(tmp_path)
    events = list(EventFileLoader(str(tmp_path / name)).Load())
    starts = [event.step for event in events if event.HasField("session_log")]
    assert starts == [4]  # TF's SessionLog.START at the first step run again
    assert event_scalars(read_events(tmp_path), "loss") == [(4, 4.0)]
