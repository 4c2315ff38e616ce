"""Profiles (draft share per budget, loading) and acceptance trace files."""

import json

import pytest

from dustin_hf import DustinConfig
from dustin_hf.experimental import config_for_budget, read_profile, write_profile
from dustin_lab.traces import (
    KNOB_TRACE_FORMAT,
    PREDICTION_FORMAT,
    TRACE_FORMAT,
    knob_trace_record,
    load_knob_trace,
    load_predictions,
    load_trace,
    prediction_record,
    trace_filename,
    trace_record,
    write_knob_trace,
    write_predictions,
    write_trace,
)


def test_profile_round_trip_and_budget_rescaling(tmp_path):
    config = DustinConfig(
        budget=512,
        draft_share=123,
        target_layer=5,
        target_heads=(0, 2),
        draft_layers=(3, 9),
        draft_heads=((0, 1), (4,)),
    )
    path = write_profile(tmp_path / "p.json", config, 0.25, recovery={"mean": 0.9})
    loaded, fraction, data = read_profile(path)
    assert loaded == config and fraction == 0.25 and data["recovery"] == {"mean": 0.9}
    assert DustinConfig.from_profile(path) == config
    assert config_for_budget(loaded, fraction, 128).draft_share == round(0.25 * (128 - 20))
    assert config_for_budget(loaded, None, 1024).draft_share == 123  # still fits: kept
    assert config_for_budget(loaded, None, 64).draft_share is None  # too large for 64: back to the default


def test_missing_or_broken_profile_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="dustin-hf calibrate"):
        read_profile(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_profile(tmp_path / "bad.json")


def test_trace_file_round_trip(tmp_path):
    pair = {"target": "t/1.5b", "draft": "d"}
    seqs = [
        {"source": {"book": "emma"}, "prompt_tokens": 10, "generated_tokens": 7, "gammas": [4, 4], "accepted": [4, 1]}
    ]
    record = trace_record(pair, "continuation", 10, 4, "dustin", 512, {"budget": 512}, 7, "float32", "cpu", seqs)
    assert record["summary"] == {"steps": 2, "mean_accepted_per_step": 2.5, "mean_tokens_per_step": 3.5}
    path = write_trace(tmp_path, record)
    assert path.name == "t_1.5b+d_continuation_ctx10_g4_dustin_b512.json"
    assert load_trace(path) == record and trace_filename(pair, "needle", 8, 2, "dense", None).endswith(
        "_g2_dense.json"
    )
    path.write_text(json.dumps({**record, "format": "other"}))
    with pytest.raises(ValueError, match=TRACE_FORMAT):
        load_trace(path)


def test_prediction_trace_round_trip(tmp_path):
    """The prediction trace keeps its five lists, summarises their agreement, and is found by the replay's glob."""
    lists = {
        "truth": [1, 2, 3, 4],
        "dense": [1, 2, 9, 4],
        "sparse": [1, 2, 9, 5],
        "draft": [1, 7, 9, 4],
        "draft_sparse": [1, 7, 9, 5],
    }
    pair = {"target": "t/1.5b", "draft": "d"}
    record = prediction_record(
        pair,
        {"kind": "python-source", "name": "stdlib:typing"},
        4096,
        4,
        512,
        {"budget": 512},
        lists,
        "float32",
        "cpu",
    )
    assert record["format"] == PREDICTION_FORMAT and record["positions"] == 4
    assert record["agreement"]["sparse_vs_dense"] == 0.75 and record["agreement"]["dense_vs_truth"] == 0.75
    path = write_predictions(tmp_path, record)
    assert path.name == "t_1.5b+d_predictions_stdlib_typing_ctx4096_g4_b512.json"
    assert list(tmp_path.glob("*_predictions_*.json")) == [path]
    assert load_predictions(path) == json.loads(json.dumps(record))
    with pytest.raises(ValueError, match="one length"):
        prediction_record(pair, {"name": "x"}, 1, 4, 8, {}, {**lists, "sparse": [1]}, "float32", "cpu")
    path.write_text(json.dumps({**record, "format": "other"}))
    with pytest.raises(ValueError, match="not a dustin_hf.prediction_trace/1"):
        load_predictions(path)


def test_knob_trace_round_trip(tmp_path):
    pair = {"target": "t-1.5b", "draft": "d"}
    config = {"min_recovery": 0.9, "budget": 512, "max_budget": 2048}
    record = knob_trace_record(
        pair,
        {"name": "stdlib:typing", "offset": 0},
        4096,
        4,
        config,
        [[4096], [4101], [4106]],
        [[600], [4101], [512]],
        [[2], [0], [4]],
        "float32",
        "cpu",
    )
    assert record["format"] == KNOB_TRACE_FORMAT and (record["min_recovery"], record["max_budget"]) == (0.9, 2048)
    assert record["summary"]["read_in_full"] == 1 and record["summary"]["max"] == 4101
    assert record["summary"]["mean_accepted_per_step"] == 2.0
    path = write_knob_trace(tmp_path, record)
    assert path.name == "t-1.5b+d_knob_stdlib_typing_ctx4096_g4_r0.9.json" and load_knob_trace(path) == record
    with pytest.raises(ValueError, match=TRACE_FORMAT):
        load_trace(path)  # an acceptance-trace reader refuses it
    with pytest.raises(ValueError, match="one entry per step"):
        knob_trace_record(pair, {"name": "x"}, 8, 4, config, [[8]], [], [], "float32", "cpu")
