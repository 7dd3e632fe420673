"""TensorBoard event files as TFRecords: appending events, and cutting a file back to a step."""

from __future__ import annotations

import functools
import glob
import os
import socket
import struct
import time
import weakref
from collections.abc import Iterator
from typing import BinaryIO

from jaxmon._base.paths import open_file

# A record: the data's length (uint64), its masked CRC-32C (uint32), the data, the data's masked CRC-32C.
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_HEADER_SIZE = _LENGTH.size + _CRC.size
_OPEN: weakref.WeakSet[EventFile] = weakref.WeakSet()


def _masked_crc(data: bytes) -> int:
    from tensorboardX.record_writer import masked_crc32c

    return masked_crc32c(data)


@functools.lru_cache(maxsize=4096)
def _length_crc(length: bytes) -> int:
    """A record length's masked CRC (lengths repeat: events of one kind are of a size)."""
    return _masked_crc(length)


class EventFile:
    """An event file of `logdir`, `events.out.tfevents.<time>.<host><suffix>`, to which
    events are appended (the first declares the file's version, as TensorFlow's).

    `flush()` hands what was written to the operating system, no further: a killed
    process loses none of it (a crashed machine may).
    """

    def __init__(self, logdir: str, suffix: str):
        from tensorboardX.proto import event_pb2

        self.path = os.path.join(logdir, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}{suffix}")
        self._file: BinaryIO = open_file(self.path, "ab")  # closed in close(); a link there is refused
        self.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        _OPEN.add(self)

    def write(self, event) -> None:
        """Appends one `Event` proto."""
        data = event.SerializeToString()
        length = _LENGTH.pack(len(data))
        self._file.write(b"".join([length, _CRC.pack(_length_crc(length)), data, _CRC.pack(_masked_crc(data))]))

    def flush(self) -> None:
        self._file.flush()

    def reopen(self) -> None:
        """Appends to the file at `path` again (after it was replaced by `cut_after`)."""
        self._file.close()
        self._file = open_file(self.path, "ab")  # closed in close()

    def close(self) -> None:
        self._file.close()
        _OPEN.discard(self)


def open_paths() -> set[str]:
    """The paths (resolved) of the event files open for writing in this process."""
    return {os.path.realpath(file.path) for file in list(_OPEN)}


def event_files(logdir: str) -> list[str]:
    """The event files directly in `logdir` (TensorBoard's `*tfevents*`)."""
    return sorted(path for path in glob.glob(os.path.join(glob.escape(logdir), "*tfevents*")) if os.path.isfile(path))


def _spans(file: BinaryIO) -> Iterator[tuple[int, int, bytes]]:
    """(start, end, data) of each record of `file`, up to the first one that is cut
    short or whose length fails its CRC (the rest of the file is unreadable to
    TensorBoard too). The data's CRC is left unchecked: its parse checks it enough."""
    start = 0
    while True:
        header = file.read(_HEADER_SIZE)
        if len(header) < _HEADER_SIZE:
            return
        (length,), (crc,) = _LENGTH.unpack_from(header), _CRC.unpack_from(header, _LENGTH.size)
        if crc != _length_crc(header[:_LENGTH.size]):
            return
        data = file.read(length)
        if len(data) < length or len(file.read(_CRC.size)) < _CRC.size:
            return
        end = start + _HEADER_SIZE + length + _CRC.size
        yield start, end, data
        start = end


def _kept_spans(path: str, step: int) -> list[tuple[int, int]] | None:
    """The byte ranges of the records of `path` to keep when it is cut back to `step`;
    None when the file is to stay as it is."""
    from google.protobuf.message import DecodeError
    from tensorboardX.proto import event_pb2

    kept: list[tuple[int, int]] = []
    dropped, read_to = False, 0
    with open(path, "rb") as file:
        for start, end, data in _spans(file):
            try:
                event = event_pb2.Event.FromString(data)
            except DecodeError:
                break
            if event.step <= step or event.HasField("file_version"):
                kept.append((start, end))
            else:
                dropped = True
            read_to = end
        size = file.seek(0, os.SEEK_END)
    if read_to == 0:  # not one readable record: no event file to cut
        return None
    return kept if dropped or read_to < size else None


def cut_after(path: str, step: int) -> bool:
    """Rewrites the event file `path` without its events of steps after `step` (of
    every kind; the file's version is kept) and without a last record a kill cut
    short. The new file replaces the old one at once (a killed process leaves one or
    the other). Returns whether the file changed.
    """
    kept = _kept_spans(path, step)
    if kept is None:
        return False
    # Named so that no reader takes it for an event file, should a kill leave it behind.
    temporary = os.path.join(os.path.dirname(path), f".jaxmon-cut.{os.getpid()}.tmp")
    with open(path, "rb") as source, open_file(temporary, "wb", fresh=True) as target:
        for start, end in kept:
            source.seek(start)
            target.write(source.read(end - start))
    os.replace(temporary, path)
    return True
