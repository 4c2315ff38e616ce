"""benchmarks/knob_curve.py: the knob's criteria are checked on every walk, against the limits of the issue."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("knob_curve", ROOT / "benchmarks" / "knob_curve.py")
knob_curve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(knob_curve)


def _walk(text, ppl, accepted_ratio, mean):
    knob = {"ppl_ratio": ppl, "tf_accepted": 2.0 * accepted_ratio, "tf_accepted_ratio": accepted_ratio,
            "sparse_vs_dense": 0.99, "budget": {"mean": mean, "p95": mean, "read_in_full": 0},
            "mean_estimated_recovery": 0.97, "mean_true_recovery": 0.95,
            "estimate_vs_truth": {"n": 3, "pearson": 0.5, "spearman": 0.4}}
    fixed = {"512": {"ppl_ratio": 1.05, "tf_accepted": 1.9, "sparse_vs_dense": 0.85, "mean_true_recovery": 0.9}}
    return {"text": text, "context": 4096, "budgets": fixed, "knob": {"0.98": knob}}


def test_a_target_passes_only_when_every_walk_meets_every_limit(tmp_path):
    good = [_walk("emma", 1.004, 0.99, 900), _walk("stdlib:typing", 1.009, 0.98, 1000)]
    assert knob_curve.criteria(knob_curve.curve(good))["0.98"]["pass"]
    for bad in (_walk("alice", 1.02, 0.99, 900), _walk("alice", 1.004, 0.95, 900), _walk("alice", 1.004, 0.99, 1100)):
        verdict = knob_curve.criteria(knob_curve.curve(good + [bad]))["0.98"]
        assert not verdict["pass"] and verdict["walks"] == 3
    point = knob_curve.curve(good)["emma@4096"]
    assert point["fixed"]["512"]["tf_accepted_ratio"] == 1.9 / 2.0  # dense's acceptance from the knob's ratio


def test_the_script_writes_its_summary(tmp_path):
    report = tmp_path / "agreement.json"
    report.write_text(json.dumps({"command": "x", "machine": {}, "results": [_walk("emma", 1.004, 0.99, 900)]}))
    summary = knob_curve.main([str(report), "--out", str(tmp_path / "knob.json")])
    assert summary["criteria"]["0.98"]["pass"] and json.loads((tmp_path / "knob.json").read_text())["walks"]
