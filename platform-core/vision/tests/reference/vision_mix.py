"""torchvision's MixUp and CutMix (transforms.v2, 0.26) on batches written by
tests/vision_mix.rs, with the parameters Kiln drew (their draws replaced).

Usage: python vision_mix.py DIR
DIR/cases.json lists the cases: {name, input, shape, dtype, labels, num_classes, op,
lam | box + lam}; the batch's pixels are DIR/<input>.bin. Writes DIR/<name>.out (the
mixed images, raw) and DIR/<name>.labels (float32 [N, num_classes], raw).
"""

import json
import os
import sys

import numpy as np
import torch
from torchvision.transforms import v2

DIR = sys.argv[1]


class ReplayedMixUp(v2.MixUp):
    def __init__(self, lam, **kw):
        super().__init__(**kw)
        self.lam = lam

    def make_params(self, flat_inputs):
        return dict(lam=self.lam)


class ReplayedCutMix(v2.CutMix):
    def __init__(self, box, lam, **kw):
        super().__init__(**kw)
        self.box, self.lam = box, lam

    def make_params(self, flat_inputs):
        return dict(box=tuple(self.box), lam_adjusted=self.lam)


for case in json.load(open(os.path.join(DIR, "cases.json"))):
    dtype = {"uint8": np.uint8, "float32": np.float32}[case["dtype"]]
    x = torch.from_numpy(np.fromfile(os.path.join(DIR, case["input"] + ".bin"), dtype=dtype)
                         .reshape(case["shape"]))
    labels = torch.tensor(case["labels"], dtype=torch.int64)
    if case["op"] == "mixup":
        t = ReplayedMixUp(case["lam"], num_classes=case["num_classes"])
    else:
        t = ReplayedCutMix(case["box"], case["lam"], num_classes=case["num_classes"])
    out, mixed = t(x, labels)
    out.contiguous().numpy().tofile(os.path.join(DIR, case["name"] + ".out"))
    mixed.to(torch.float32).contiguous().numpy().tofile(os.path.join(DIR, case["name"] + ".labels"))
print("ok")
