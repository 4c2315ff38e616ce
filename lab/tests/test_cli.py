"""The dustin-hf command on tiny saved models: calibrate, eval, demo, --help and the usage errors."""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest
from cli_fixtures import save_pair, tiny_qwen, tiny_tokenizer
from tiny_models import one_thread  # noqa: F401  (the fixture below)

import dustin_hf
from dustin_hf import DustinConfig
from dustin_lab import cli
from dustin_lab.traces import TRACE_FORMAT, load_trace

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("pair"))


def _run(capsys, *argv):
    code = cli.main(list(argv) + ["--quiet"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _models(dirs):
    return ["--target", str(dirs[0]), "--draft", str(dirs[1])]


@pytest.fixture(scope="module")
def profile(dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny.json"
    assert (
        cli.main(
            [
                "calibrate",
                *_models(dirs),
                "--books",
                "alice",
                "--context",
                "160",
                "--steps-per-book",
                "3",
                "--min-position",
                "100",
                "--budgets",
                "24,48",
                "--profile-budget",
                "48",
                "--time-limit",
                "30",
                "--out",
                str(path),
                "--quiet",
            ]
        )
        == 0
    )
    return path


def test_calibrate_writes_a_loadable_profile(profile, dirs):
    data = json.loads(profile.read_text())
    for key in (
        "config",
        "draft_share_fraction",
        "recovery",
        "default_recovery",
        "model_pair",
        "texts",
        "seconds",
        "command",
        "machine",
    ):
        assert key in data
    assert data["recovery"]["mean"] >= data["default_recovery"]["mean"] - 1e-6  # the search starts from a superset
    config = DustinConfig.from_profile(profile)
    assert config.budget == 48 and config.target_layer is not None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dirs[0])
    with dustin_hf.patch(model, profile) as handle:
        assert handle.config == config


def test_eval_reports_every_section_and_writes_traces(capsys, dirs, profile, tmp_path):
    out = tmp_path / "fidelity.json"
    code, stdout, stderr = _run(
        capsys,
        "eval",
        *_models(dirs),
        "--profile",
        str(profile),
        "--books",
        "alice",
        "--contexts",
        "120",
        "--budgets",
        "24,512",
        "--ppl-tokens",
        "17",
        "--new-tokens",
        "8",
        "--needle-contexts",
        "120",
        "--needle-depths",
        "0.5",
        "--needle-books",
        "alice",
        "--needle-new-tokens",
        "4",
        "--min-context",
        "32",
        "--out",
        str(out),
        "--traces-dir",
        str(tmp_path / "traces"),
        "--no-plot",
        "--json",
    )
    assert code == 0
    report = json.loads(stdout)
    assert (
        report["command"].startswith("dustin-hf eval") and json.loads(out.read_text())["summary"] == report["summary"]
    )
    assert {"command", "machine", "perplexity", "continuations", "needles", "summary", "trace_files"} <= set(report)
    row = report["summary"]["per_context"]["120"]
    assert row["512"]["ppl_ratio"] == 1.0  # the budget covers the context: dense verification, bit for bit
    assert row["24"]["recovery"] is not None and 0 < row["24"]["recovery"] < 1
    assert set(report["summary"]["needle_accuracy"]["120"]) == {"dense", "24", "512"}
    assert len(report["trace_files"]) == 6  # (continuation, needle) x (dense, 24, 512)
    # exact mode beside sparse mode: at 24 the sparse continuation may differ, exact mode's may not
    assert row["24"]["exact_identical"] and row["24"]["exact_token_agreement"] == 1.0
    assert row["24"]["exact_sparse_row_steps"] > 0 and 0 <= row["24"]["exact_confirmed_fraction"] <= 1
    assert report["summary"]["criteria"]["120"]["exact_identical_to_dense"]["pass"]
    assert "exact mode (the same selection" in stderr
    trace = load_trace(report["trace_files"][0])
    assert trace["format"] == TRACE_FORMAT and trace["gamma"] == 4
    seq = trace["sequences"][0]
    assert len(seq["accepted"]) == len(seq["gammas"]) and all(0 <= a <= 4 for a in seq["accepted"])


def test_eval_sweeps_the_knob_beside_the_budgets(capsys, dirs, profile, tmp_path):
    """--targets: per target the perplexity and acceptance against dense and the positions read (a target of 1.0
    reads every step in full, so it is dense verification); the estimate against the truth; the plot."""
    out = tmp_path / "knob.json"
    code, stdout, stderr = _run(
        capsys,
        "eval",
        *_models(dirs),
        "--profile",
        str(profile),
        "--books",
        "alice,stdlib:typing",
        "--contexts",
        "120",
        "--budgets",
        "24,48",
        "--targets",
        "0.6,1.0",
        "--target-budget",
        "24",
        "--max-budget",
        "64",
        "--ppl-tokens",
        "41",
        "--new-tokens",
        "6",
        "--needle-contexts",
        "",
        "--min-context",
        "32",
        "--out",
        str(out),
        "--traces-dir",
        str(tmp_path / "traces"),
        "--plot",
        str(tmp_path / "knob.png"),
        "--json",
    )
    assert code == 0
    report = json.loads(stdout)
    knob, criteria = report["summary"]["knob"]["120"], report["summary"]["knob_criteria"]["120"]
    assert set(knob) == set(criteria) == {"0.6", "1.0"}
    assert knob["1.0"]["ppl_ratio"] == 1.0 and knob["1.0"]["tf_accepted_ratio"] == 1.0 and criteria["1.0"]["pass"]
    assert knob["1.0"]["read"]["read_in_full"] == knob["1.0"]["read"]["steps"] == 2 * 8  # two texts, 8 steps each
    assert 24 <= knob["0.6"]["read"]["mean"] <= knob["1.0"]["read"]["mean"] and knob["0.6"]["read"]["max"] <= 155
    assert 0.6 <= knob["0.6"]["estimated_recovery"] <= 1 and 0 < knob["0.6"]["recovery"] <= 1
    walk = report["perplexity"][0]["targets"]["0.6"]
    assert len(walk["steps_read"]) == len(walk["steps_estimated_recovery"]) == len(walk["accepted_trace"]) == 8
    assert report["summary"]["estimate_vs_truth"]["120"]["budget 24"]["n"] == 16
    assert (
        "stats" not in report["continuations"][0]["targets"]["0.6"]
        and report["continuations"][0]["targets"]["0.6"]["knob"]
    )
    if importlib.util.find_spec("matplotlib") is not None:  # an optional dependency (the lab's [models] extra)
        assert (tmp_path / "knob.png").stat().st_size > 0 and report["plot"] == str(tmp_path / "knob.png")
    else:
        assert report["plot"] is None and not (tmp_path / "knob.png").exists()
    assert "quality knob" in stderr and "estimate vs truth @ 120" in stderr


def test_demo_prints_what_was_measured(capsys, dirs):
    code, stdout, _ = _run(
        capsys,
        "demo",
        *_models(dirs),
        "--context",
        "120",
        "--new-tokens",
        "8",
        "--budget",
        "24",
        "--min-context",
        "32",
        "--book",
        "alice",
    )
    assert code == 0
    assert "Measured on cpu" in stdout and "classic speculative decoding" in stdout and "Dustin (budget 24" in stdout
    assert "sparse_steps" in stdout and "agreement with the dense text" in stdout and "tokens/s" in stdout
    assert "exact Dustin (budget 24" in stdout and "confirmations kept" in stdout and "three levels" in stdout


def test_demo_json(capsys, dirs):
    code, stdout, stderr = _run(
        capsys,
        "demo",
        *_models(dirs),
        "--context",
        "100",
        "--new-tokens",
        "6",
        "--budget",
        "24",
        "--min-context",
        "32",
        "--book",
        "alice",
        "--json",
    )
    assert code == 0
    result = json.loads(stdout)
    assert (
        set(result["runs"]) == {"dense", "dustin", "exact"} and result["runs"]["dustin"]["stats"]["sparse_steps"] > 0
    )
    assert "Measured on" in stderr
    dense, dustin = result["runs"]["dense"], result["runs"]["dustin"]
    assert "stats" not in dense  # transformers' own assisted decoding: a DynamicCache
    for run in (dense, dustin, result["runs"]["exact"]):  # each model reads the 120-token prompt in one forward
        assert run["prompt_forwards"] == 2
    for run in (dense, dustin):
        assert len(run["tokens"]) == 6 and run["decode_steps"] >= 1
        # the forward that read the prompt committed the rest: one token (Dustin), or a first step (transformers)
        assert 6 - 5 <= run["decode_tokens"] <= 6 - 1
        assert 0 <= run["mean_accepted_per_step"] <= 4 and run["prefill_seconds"] <= run["generate_seconds"]
    # the streamer's count of steps after the prompt matches Dustin's own (its first step follows the prompt)
    assert dustin["decode_steps"] == dustin["stats"]["steps"] and dustin["decode_tokens"] == 6 - 1
    assert 0 <= dustin["agreement_with_dense"]["prefix"] <= 6
    exact = result["runs"]["exact"]
    assert exact["agreement_with_dense"]["identical"] and exact["stats"]["sparse_steps"] > 0
    assert exact["stats"]["exact"]["sparse_row_steps"] > 0 and exact["generate_kwargs"]["cache_config"] == {
        "mode": "exact"
    }
    # its confirming steps forward more than γ + 1 tokens, and are steps, not prompt reading (the streamer sees
    # confirmed tokens only: a sparse step commits nothing)
    assert exact["stats"]["exact"]["confirm_steps"] > 0 and 1 <= exact["decode_steps"] <= exact["stats"]["steps"]
    assert exact["decode_seconds"] > 0 and exact["decode_tokens_per_s"] > 0


def test_demo_calibrates_on_the_prompt(capsys, dirs, profile):
    code, stdout, _ = _run(
        capsys,
        "demo",
        *_models(dirs),
        "--context",
        "120",
        "--new-tokens",
        "6",
        "--budget",
        "24",
        "--min-context",
        "32",
        "--book",
        "alice",
        "--calibration",
        "prompt",
    )
    assert code == 0 and "calibrated on the prompt in" in stdout and "default heads" in stdout
    code, _, err = _run(capsys, "demo", *_models(dirs), "--profile", str(profile), "--calibration", "prompt")
    assert code == 2 and "one or the other" in err


def test_missing_model_path_is_a_clear_error(capsys, tmp_path, dirs):
    code, _, err = _run(capsys, "demo", "--target", str(tmp_path / "nope"), "--draft", str(dirs[1]))
    assert code == 2 and "target model path" in err and "does not exist" in err
    code, _, err = _run(capsys, "demo", "--target", str(dirs[0]))
    assert code == 2 and "both --target and --draft" in err


def test_mismatched_tokenizers_are_refused(capsys, tmp_path, dirs):
    other = tmp_path / "other"
    tiny_qwen(len(tiny_tokenizer(120)), layers=2).save_pretrained(other)
    tiny_tokenizer(120).save_pretrained(other)
    code, _, err = _run(capsys, "demo", "--target", str(dirs[0]), "--draft", str(other))
    assert code == 2 and "tokenizers differ" in err


def test_text_shorter_than_the_context_is_refused_before_loading(capsys, dirs):
    code, _, err = _run(capsys, "demo", *_models(dirs), "--book", "alice", "--context", "10000000")
    assert code == 2 and "too few for 10,000,000 tokens" in err


def test_help_imports_neither_torch_nor_transformers():
    """`dustin-hf --help` and each `dustin-hf <command> --help` answer before anything heavy is imported."""
    script = textwrap.dedent("""
        import sys
        import dustin_hf
        from dustin_lab import cli
        assert "torch" not in sys.modules, "import dustin_hf imported torch"
        for argv in [["--help"]] + [[name, "--help"] for name in cli.COMMANDS]:
            try:
                cli.main(argv)
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
            heavy = [m for m in ("torch", "transformers") if m in sys.modules]
            assert not heavy, (argv, heavy)
        from dustin_hf import DustinConfig, patch  # the public names still load, on first use
        assert "torch" in sys.modules and callable(patch) and DustinConfig().budget > 0
        print("commands", len(cli.COMMANDS))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "commands 4"


@pytest.mark.parametrize("command", ["fetch-models", "demo", "calibrate", "eval"])
def test_every_command_has_help(capsys, command):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    assert "default" in capsys.readouterr().out
