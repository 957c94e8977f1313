"""Reads back the TensorBoard event files kiln_core's TensorBoardSink wrote
(tests/logger_tensorboard.rs).

Usage: python logger_tensorboard.py LOGDIR

Loads LOGDIR with TensorBoard's own EventAccumulator (keeping every scalar), and
separately checks every TFRecord of every event file by hand: the masked CRC-32C of the
length and of the data, and that each record parses as an Event protobuf. Prints one
JSON object:

    {"files": [event file names],
     "records": number of records checked,
     "file_version": the first event's file_version,
     "scalars": {tag: [[step, value], ...]}}

Values are the float32 scalars as Python floats (exact).
"""

import json
import os
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.proto import event_pb2


def crc32c(data):
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data):
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def check_records(path):
    """Every record's framing and checksums; returns the parsed events."""
    events = []
    with open(path, "rb") as f:
        blob = f.read()
    pos = 0
    while pos < len(blob):
        header = blob[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        (length_crc,) = struct.unpack("<I", blob[pos + 8 : pos + 12])
        assert length_crc == masked_crc32c(header), f"{path}: bad length CRC at {pos}"
        data = blob[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack("<I", blob[pos + 12 + length : pos + 16 + length])
        assert data_crc == masked_crc32c(data), f"{path}: bad data CRC at {pos}"
        event = event_pb2.Event()
        event.ParseFromString(data)
        events.append(event)
        pos += 16 + length
    assert pos == len(blob), f"{path}: trailing bytes"
    return events


def main():
    logdir = sys.argv[1]
    files = sorted(n for n in os.listdir(logdir) if "tfevents" in n)
    records, file_version = 0, None
    for name in files:
        events = check_records(os.path.join(logdir, name))
        records += len(events)
        if file_version is None and events:
            file_version = events[0].file_version

    acc = event_accumulator.EventAccumulator(
        logdir, size_guidance={event_accumulator.SCALARS: 0}
    )
    acc.Reload()
    scalars = {
        tag: [[e.step, e.value] for e in acc.Scalars(tag)]
        for tag in acc.Tags()[event_accumulator.SCALARS]
    }
    print(
        json.dumps(
            {
                "files": files,
                "records": records,
                "file_version": file_version,
                "scalars": scalars,
            }
        )
    )


if __name__ == "__main__":
    main()
