"""benchmarks/ab_compare.py: the old-vs-new A/B's ratios pool both orders and keep each order's own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ab_compare  # noqa: E402


def _run(label: str, decode: float, call: float) -> dict:
    point = dict(context=8192, batch=4, decode_tokens_per_s=decode, call_seconds=call, warmup_seconds=2 * call)
    tree = f"/{label}/dustin_hf/__init__.py"
    return dict(label=label, dustin_hf=tree, gpu="GPU", versions={}, decode_tokens=8, call_tokens=4, points=[point])


def test_ratios_pool_both_orders_and_pair_each_run_with_its_neighbour(tmp_path):
    runs = [_run("old", 100, 2.0), _run("new", 102, 2.0), _run("new", 98, 1.9), _run("old", 100, 2.1)]
    files = []
    for i, run in enumerate(runs):
        files.append(tmp_path / f"ab_{i}.txt")
        files[-1].write_text(f"{run['label']}: progress\nAB {json.dumps(run)}\n")
    result = ab_compare.main([*map(str, files), "--out", str(tmp_path / "ab.json")])
    decode, call = (next(r for r in result["rows"] if r["measure"] == m) for m in ("decode", "call"))
    assert decode["ratio"] == pytest.approx(200 / 200) and decode["ratio_by_order"] == pytest.approx([1.02, 0.98])
    assert call["ratio"] == pytest.approx(3.9 / 4.1) and not call["within"]
    assert result["order"] == ["old", "new", "new", "old"]
    assert json.loads((tmp_path / "ab.json").read_text())["rows"][0]["measure"] == "decode"


def test_a_run_without_its_line_is_named(tmp_path):
    (tmp_path / "ab_1.txt").write_text("Traceback ...\n")
    with pytest.raises(SystemExit, match="ab_1.txt: no AB line"):
        ab_compare.read_runs([tmp_path / "ab_1.txt"])
