"""WriterSlot: a hook's writer, given or shared by directory."""

from __future__ import annotations

import os
import weakref
from typing import Any

from jaxmon._ops import report_thread
from jaxmon._writers.cache import SummaryWriterCache
from jaxmon._writers.interface import SummaryWriter, restart

_OPEN: weakref.WeakSet[WriterSlot] = weakref.WeakSet()  # the slots between open() and close()


def flush_all() -> None:
    """Flushes every writer open in this process through a hook (`WriterSlot`) or
    `SummaryWriterCache`: what they were given reaches the operating system, so that a
    killed process loses none of it. Call it before a checkpoint is saved: then every
    summary of the steps the checkpoint covers is on disk when it is.

    Example:
      >>> import tempfile
      >>> handle = SummaryWriterCache.get(tempfile.mkdtemp())
      >>> handle.write_scalars(1, {"loss": 0.5})
      >>> flush_all()  # metrics.jsonl and the event file hold step 1
      >>> handle.close()
    """
    report_thread.wait()  # the hooks' reports queued on the report thread, written to given writers too
    SummaryWriterCache.flush()
    given = {id(slot.given): slot.given for slot in list(_OPEN) if slot.given is not None}  # the rest are cached
    for writer in given.values():
        writer.flush()


class WriterSlot:
    """A hook's writer: the one it was given (flushed, never closed by the hook) or the
    shared one of `output_dir` (opened in `begin`, released in `close`); with neither and
    `follows_session`, the shared one of the session's `summary_dir` (a
    `MonitoredTrainingSession`'s, on the chief), from `after_create_session` on."""

    def __init__(self, owner: str, output_dir: str | os.PathLike | None, summary_writer: Any, required: bool,
                 follows_session: bool = False):
        if output_dir is not None and summary_writer is not None:
            raise ValueError(f"{owner} takes output_dir= or summary_writer=, not both; got output_dir="
                             f"{output_dir!r} and summary_writer={summary_writer!r}.")
        if summary_writer is not None and not isinstance(summary_writer, SummaryWriter):
            raise TypeError(f"{owner} summary_writer={summary_writer!r} lacks the SummaryWriter methods "
                            "(write_scalars, write_histograms, write_images, write_texts, write_hparams, "
                            "flush, close); use jm.TensorBoardWriter(dir) or jm.JsonlWriter(path).")
        if required and output_dir is None and summary_writer is None:
            raise ValueError(f"{owner} needs somewhere to write: output_dir= (a directory for TensorBoard "
                             "event files and metrics.jsonl) or summary_writer=.")
        self.output_dir, self.given, self.follows_session = output_dir, summary_writer, follows_session
        self.writer: Any = summary_writer

    def open(self) -> None:
        if self.given is None and self.output_dir is not None and self.writer is None:
            self.writer = SummaryWriterCache.get(self.output_dir)
        if self.writer is not None:
            _OPEN.add(self)

    def restarted(self, session: Any) -> None:
        """After a session was created: the session's writer, if this slot follows it;
        after it restored a checkpoint, the writer forgets what was written after its step
        (see `TensorBoardWriter.restart`)."""
        summary_dir = getattr(session, "summary_dir", None)
        if self.writer is None and self.follows_session and self.output_dir is None and summary_dir is not None:
            self.writer = SummaryWriterCache.get(summary_dir)
            _OPEN.add(self)
        if session.restored_step is not None and self.writer is not None:
            restart(self.writer, session.restored_step)

    def close(self) -> None:
        _OPEN.discard(self)
        writer = self.writer
        if writer is None:
            return
        if writer is self.given:
            writer.flush()
        else:
            self.writer = None
            writer.close()
