"""Reads a run's TensorBoard log directory with TensorBoard's own
EventAccumulator (tests/cli_resume.rs, the [logging] views).

Usage: tensorboard_views.py LOGDIR

Prints one JSON object:

    {"scalars": {tag: [[step, value], ...]},
     "histograms": {tag: [[step, min, max, num, sum, sum_squares, [limits], [counts]], ...]},
     "graph": null or {"nodes": count, "ops": [op type, ...]},
     "images": {tag: [[step, width, height], ...]},
     "texts": {tag: [[step, text], ...]}}
"""

import json
import sys

# TensorFlow is not needed, and TensorBoard imports it when it finds it (seconds):
# without it TensorBoard reads events with its own protobufs.
sys.modules["tensorflow"] = None

from tensorboard.backend.event_processing import event_accumulator  # noqa: E402


def main():
    acc = event_accumulator.EventAccumulator(
        sys.argv[1],
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.HISTOGRAMS: 0,
            event_accumulator.IMAGES: 0,
            event_accumulator.TENSORS: 0,
        },
    )
    acc.Reload()
    tags = acc.Tags()
    scalars = {
        tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in tags[event_accumulator.SCALARS]
    }
    histograms = {}
    for tag in tags[event_accumulator.HISTOGRAMS]:
        rows = []
        for e in acc.Histograms(tag):
            h = e.histogram_value
            rows.append(
                [e.step, h.min, h.max, h.num, h.sum, h.sum_squares, list(h.bucket_limit), list(h.bucket)]
            )
        histograms[tag] = rows
    graph = None
    if tags.get("graph"):
        # TensorBoard's own parse of the GraphDef: the op types and node count.
        nodes = acc.Graph().node
        graph = {"nodes": len(nodes), "ops": sorted({n.op for n in nodes})}
    images = {
        tag: [[e.step, e.width, e.height] for e in acc.Images(tag)] for tag in tags[event_accumulator.IMAGES]
    }
    texts = {
        tag: [[e.step, e.tensor_proto.string_val[0].decode()] for e in acc.Tensors(tag)]
        for tag in tags[event_accumulator.TENSORS]
    }
    print(
        json.dumps(
            {"scalars": scalars, "histograms": histograms, "graph": graph, "images": images, "texts": texts}
        )
    )


if __name__ == "__main__":
    main()
