"""Reference values from scikit-learn for kiln_core's metrics (tests/metric_sklearn.rs).

Usage: python logger_metrics.py CASES.json

CASES.json, written by the Rust test, holds random logits and targets:

    {"classification": [{"name", "classes", "logits": [[float] * C] * N,
                         "targets": [int] * N, "ks": [int]}],
     "regression": [{"name", "pred": [...], "target": [...]}]}   (1-D or 2-D lists)

Prints one JSON object with scikit-learn's values for each case:

    {"classification": [{"name", "accuracy", "top_k": {"k": value},
                         "precision", "recall", "f1"}],
     "regression": [{"name", "mae"}]}

Predictions are the argmax of the logits (the first maximum, like torch.argmax).
Precision, recall and F1 are precision_recall_fscore_support(average="macro",
zero_division=0) with scikit-learn's default label set (the classes present in the
targets or the predictions).
"""

import json
import sys
import warnings

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    mean_absolute_error,
    precision_recall_fscore_support,
    top_k_accuracy_score,
)


def classification(case):
    logits = np.asarray(case["logits"], dtype=np.float64)
    targets = np.asarray(case["targets"], dtype=np.int64)
    classes = case["classes"]
    assert logits.shape == (len(targets), classes), logits.shape
    pred = np.argmax(logits, axis=1)
    p, r, f, _ = precision_recall_fscore_support(
        targets, pred, average="macro", zero_division=0
    )
    top_k = {}
    for k in case["ks"]:
        with warnings.catch_warnings():
            # k >= n_classes warns that the score is trivially 1.
            warnings.simplefilter("ignore")
            top_k[str(k)] = float(
                top_k_accuracy_score(targets, logits, k=k, labels=np.arange(classes))
            )
    return {
        "name": case["name"],
        "accuracy": float(accuracy_score(targets, pred)),
        "top_k": top_k,
        "precision": float(p),
        "recall": float(r),
        "f1": float(f),
    }


def regression(case):
    pred = np.asarray(case["pred"], dtype=np.float64)
    target = np.asarray(case["target"], dtype=np.float64)
    return {"name": case["name"], "mae": float(mean_absolute_error(target, pred))}


def main():
    with open(sys.argv[1]) as f:
        cases = json.load(f)
    print(
        json.dumps(
            {
                "classification": [classification(c) for c in cases["classification"]],
                "regression": [regression(c) for c in cases["regression"]],
            }
        )
    )


if __name__ == "__main__":
    main()
