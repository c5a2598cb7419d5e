"""How well can an engine predict that a conversation gets another turn?

On the Mooncake conversation trace the offline optimum's lead over online
eviction policies is conversations that come back after a long idle gap, so an
online policy would have to tell, when a turn ends, whether its conversation
returns. This script measures how well that can be
predicted from what an engine knows at that moment, with a gradient-boosted
classifier (scikit-learn, not a kvkit dependency: ``pip install scikit-learn``).

Features per request: turn number, prompt tokens, output tokens, tokens new in
this turn, the previous idle gap and the mean of all earlier gaps, seconds since
the conversation began, arrivals in the last minute, and prompt blocks. Label:
the conversation's next turn arrives within ``--horizon`` seconds (requests
closer than that to the trace's end are left out). A request's predecessor is
the latest earlier request holding its deepest shared block past block 0.

Prints the ROC AUC of each feature alone and of the classifier, cross-validated
(5 shuffled folds) and trained on the first half of the trace, tested on the
second. Usage::

    python benchmarks/next_turn_predictability.py --trace PATH [--horizon 600] [--json]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import KFold, cross_val_predict

from kvkit import read_trace

FEATURES = ("turn", "prompt_tokens", "output_tokens", "new_tokens", "last_gap_s",
            "mean_gap_s", "conversation_age_s", "arrivals_last_60s", "prompt_blocks")


def predecessors(requests) -> list[int]:
    """Index of each request's previous turn (-1 for a first turn)."""
    latest: dict[int, int] = {}
    out = []
    for i, r in enumerate(requests):
        out.append(next((latest[h] for h in reversed(r.hash_ids[1:]) if h in latest), -1))
        for h in r.hash_ids[1:]:
            latest[h] = i
    return out


def table(requests, prev: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Feature matrix and arrival seconds, one row per request."""
    t = np.array([r.timestamp_ms for r in requests]) / 1000
    turn, start, gaps = [0] * len(requests), t.copy(), [[] for _ in requests]
    rows = []
    for i, r in enumerate(requests):
        p = prev[i]
        if p >= 0:
            turn[i], start[i], gaps[i] = turn[p] + 1, start[p], gaps[p] + [t[i] - t[p]]
        new = r.input_length - (requests[p].input_length + requests[p].output_length) if p >= 0 else r.input_length
        g = gaps[i]
        rows.append([turn[i], r.input_length, r.output_length, new, g[-1] if g else -1,
                     np.mean(g) if g else -1, t[i] - start[i], i - np.searchsorted(t, t[i] - 60),
                     len(r.hash_ids)])
    return np.array(rows, float), t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--horizon", type=float, default=600.0, help="seconds within which the next turn counts")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    requests = list(read_trace(args.trace))
    prev = predecessors(requests)
    x, t = table(requests, prev)
    following = {}
    for i, p in enumerate(prev):
        following.setdefault(p, i)
    y = np.array([i in following and t[following[i]] - t[i] <= args.horizon for i in range(len(requests))])
    keep = t <= t[-1] - args.horizon
    x, y, t = x[keep], y[keep], t[keep]
    model = HistGradientBoostingClassifier(max_iter=100, learning_rate=0.05, max_leaf_nodes=7)
    cv = cross_val_predict(model, x, y, cv=KFold(5, shuffle=True, random_state=0), method="predict_proba")[:, 1]
    first = t < np.median(t)
    split = model.fit(x[first], y[first]).predict_proba(x[~first])[:, 1]
    report = {
        "requests": int(keep.sum()), "positive_rate": round(float(y.mean()), 3), "horizon_s": args.horizon,
        "feature_auc": {n: round(float(roc_auc_score(y, x[:, j])), 3) for j, n in enumerate(FEATURES)},
        "model_auc_cv": round(float(roc_auc_score(y, cv)), 3),
        "model_auc_time_split": round(float(roc_auc_score(y[~first], split)), 3),
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
