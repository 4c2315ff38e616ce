"""Old code vs new code in one process: the same models decoded by the library before and after a change.

Issue #23's check that the restructure cost no speed: the library as of ``--old-commit`` (default 03992c4, the
layout before the restructure) and the working tree's, each running its own ``benchmarks/e2e.py``'s
``run_speculative`` on the same two models (built once: random bf16 weights, 7B + 0.5B shapes, one GPU),
alternating for ``--rounds`` rounds after one untimed warm-up run of each, every round starting with the code
the round before ended with. Both replay the same acceptance counts (the teacher-forced sparse-draft traces of
``run_h200.sh e2e``), so both do the same steps; the JSON keeps each run's rate and step counts, and the medians'
ratio.

The old tree is materialised from git where the repository is (the GPU machine has no git history) into a
folder that travels with the device call: ``git archive`` of ``dustin_hf``, ``patches`` and
``benchmarks/e2e.py``; the package renamed ``dustin_hf_old`` (its ``dustin_hf`` imports rewritten, ``patches/``
moved inside it as the old pyproject's package-dir mapped it, the bundled books left out), its attention
function renamed ``"dustin_old"`` so that the two codes' registrations in transformers' attention registry do not
replace each other, and its ``e2e.py`` saved as ``e2e_old.py``:

    python benchmarks/ab_old_new.py --build-old build/ab_old               # here, once (needs git)
    python benchmarks/ab_old_new.py --old-tree build/ab_old --out ab.json  # on the GPU (carry build/ab_old)
    python benchmarks/ab_old_new.py --old-tree build/ab_old --tiny         # CPU check: tiny models, both codes

Prints one line per run, then the medians and their ratio, then one JSON line.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

import e2e
from replay import CountReplay

OLD_COMMIT = "03992c4"
OLD_PACKAGE = "dustin_hf_old"
OLD_ATTENTION = "dustin_old"
MARKER = "OLD_TREE.json"  # written into a built tree: what it was built from
TRACE = ("benchmarks/traces/qwen2.5-coder-1.5b-instruct+qwen2.5-coder-0.5b-instruct_teacher-forced_ctx{}_g4_"
         "dustin-sparse-draft_b512.json")
TOLERANCE = 0.02  # issue #23: old and new within 2% of each other
# --tiny: past the budget (512) so that the sparse paths run, a few tokens per row
TINY = dict(context=768, batch=2, new_tokens=32, rounds=1)
_REPO = Path(__file__).resolve().parents[1]
_IMPORT = re.compile(r"^(\s*)(from|import)(\s+)dustin_hf(?=[\s.])", re.M)


# ----------------------------------------------------------------------------- the old tree
def build_old(folder: str | Path, commit: str = OLD_COMMIT) -> Path:
    """Materialise ``commit``'s library as the package ``dustin_hf_old`` under ``folder`` (see the module
    docstring); ``folder`` must be new or a tree this function built. Returns ``folder``."""
    folder = Path(folder)
    if folder.exists():
        if not (folder / MARKER).is_file():
            raise SystemExit(f"{folder} exists and is not an old tree built by this script; choose a new folder")
        shutil.rmtree(folder)
    archive = subprocess.run(["git", "-C", str(_REPO), "archive", commit, "dustin_hf", "patches", "benchmarks/e2e.py"],
                             capture_output=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        package = folder / OLD_PACKAGE
        folder.mkdir(parents=True)
        shutil.copytree(Path(tmp) / "dustin_hf", package, ignore=shutil.ignore_patterns("data"))
        shutil.copytree(Path(tmp) / "patches", package / "patches")
        shutil.copy(Path(tmp) / "benchmarks" / "e2e.py", folder / "e2e_old.py")
    rewritten = [_rewrite(path) for path in sorted(folder.rglob("*.py"))]
    attention = package / "attention.py"
    text = attention.read_text()
    if text.count('ATTENTION_NAME = "dustin"\n') != 1:
        raise SystemExit(f"{attention}: expected one ATTENTION_NAME = \"dustin\" line to rename")
    attention.write_text(text.replace('ATTENTION_NAME = "dustin"\n', f'ATTENTION_NAME = "{OLD_ATTENTION}"\n'))
    revision = subprocess.run(["git", "-C", str(_REPO), "rev-parse", commit], capture_output=True, text=True,
                              check=True).stdout.strip()
    # the new side's commit, kept here because the device machine's copy of the tree has no git history
    (folder / MARKER).write_text(json.dumps(dict(commit=revision, package=OLD_PACKAGE, attention=OLD_ATTENTION,
                                                 rewritten_imports=sum(rewritten), built_beside=_head()),
                                            indent=1) + "\n")
    return folder


def _rewrite(path: Path) -> int:
    """Point ``path``'s ``dustin_hf`` imports (and its package-data lookups) at ``dustin_hf_old``; how many."""
    text = path.read_text()
    text, count = _IMPORT.subn(rf"\1\2\3{OLD_PACKAGE}", text)
    text = text.replace('resources.files("dustin_hf")', f'resources.files("{OLD_PACKAGE}")')
    path.write_text(text)
    return count


def load_old(folder: str | Path):
    """Import a built old tree: its ``e2e_old`` module, with its attention function registered."""
    folder = Path(folder)
    if not (folder / MARKER).is_file():
        raise SystemExit(f"{folder} is not an old tree: build it with --build-old {folder} (where git is)")
    sys.path.insert(0, str(folder.resolve()))
    import e2e_old
    from transformers import AttentionInterface

    attention = __import__(f"{OLD_PACKAGE}.attention", fromlist=["ATTENTION_NAME"])
    AttentionInterface.register(attention.ATTENTION_NAME, attention.dustin_attention)
    return e2e_old, json.loads((folder / MARKER).read_text())


# ----------------------------------------------------------------------------- the A/B
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build-old", metavar="DIR", help="materialise the old tree into DIR and exit")
    parser.add_argument("--old-commit", default=OLD_COMMIT,
                        help=f"with --build-old: the old code (default {OLD_COMMIT})")
    parser.add_argument("--old-tree", metavar="DIR", help="a tree built by --build-old")
    parser.add_argument("--method", default="dustin_sparse_draft",
                        choices=("spec_dense", "dustin", "dustin_sparse_draft"))
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=e2e.NEW_TOKENS)
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of each code (default 3)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"tiny models on the CPU ({TINY}): checks that both codes run")
    parser.add_argument("--out", help="save the runs as JSON (with command, device and versions)")
    args = parser.parse_args(argv)
    if args.build_old:
        folder = build_old(args.build_old, args.old_commit)
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        print(f"old tree of {args.old_commit} in {folder} ({size / 2**20:.1f} MiB)")
        return {}
    if not args.old_tree:
        parser.error("pass --old-tree DIR (built by --build-old DIR)")
    if args.tiny:
        args.context, args.batch, args.new_tokens, args.rounds = (TINY[k] for k in ("context", "batch", "new_tokens",
                                                                                   "rounds"))
        devices, sizes, dtype = [torch.device("cpu")], ("tiny", "tiny-draft"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --tiny)")
        devices, sizes, dtype = [torch.device("cuda:0")], ("7b", "0.5b"), torch.bfloat16
    e2e_old, built = load_old(args.old_tree)

    torch.manual_seed(0)
    target = e2e.build_model(sizes[0], devices, dtype)
    draft = e2e.build_model(sizes[1], devices, dtype)
    import dustin_hf

    dustin_hf.patch(target)  # the new code's attention; the old one's is registered by load_old
    traces = [str(_REPO / TRACE.format(n)) for n in (4096, 8192)]
    new_replay = CountReplay.load(traces, e2e.GAMMA)
    new_method = e2e.Sources(None, {args.method: new_replay}, None, None, e2e.BUDGET, e2e.BUDGET).method(
        args.method, args.context)
    codes = {  # each code's own run_speculative, with its own replay of the same counts
        "old": lambda: e2e_old.run_speculative(target, draft, args.batch, args.context, args.method,
                                               e2e_old.Replay.load(traces), dtype, args.new_tokens),
        "new": lambda: e2e.run_speculative(target, draft, args.batch, args.context, new_method, dtype, args.new_tokens),
    }

    runs = []
    order = ["old", "new"]
    for round_ in range(args.rounds + 1):  # round 0: the untimed warm-up of each code
        for code in order:
            row = codes[code]()
            run = dict(code=code, round=round_, warmup=round_ == 0, **{k: row.get(k) for k in _KEPT})
            runs.append(run)
            failed = {part: g["failed"] for part, g in (row.get("graphs") or {}).items() if g.get("failed")}
            print(f"{'warm-up ' if run['warmup'] else ''}{code}: {row['tokens_per_s']:.1f} tok/s (steady "
                  f"{row.get('steady_tokens_per_s', float('nan')):.1f}), {row['steps']} steps, "
                  f"{row['tokens_per_step']:.3f} tok/step/row, backend {row.get('backend')}"
                  + (f"; CUDA graphs that failed to capture: {failed}" if failed else ""), flush=True)
        order.reverse()
    summary = _summary(runs)
    print(f"median tok/s: old {summary['old']['tokens_per_s']:.1f}, new {summary['new']['tokens_per_s']:.1f}; "
          f"new / old = {summary['ratio']:.4f} (steady {summary['steady_ratio']:.4f}); within "
          f"{100 * TOLERANCE:.0f}%: {summary['within_tolerance']}; same steps: {summary['same_work']}")
    result = dict(command=" ".join(["python3", *sys.argv]),
                  device=torch.cuda.get_device_name(0) if devices[0].type == "cuda" else "cpu",
                  versions=e2e._versions(), old=built, new=_head() if (_REPO / ".git").exists()
                  else f"{built['built_beside']} (the checkout the old tree was built beside)",
                  pair=f"{sizes[0]} + {sizes[1]}",
                  method=args.method, context=args.context, batch=args.batch, new_tokens=args.new_tokens,
                  acceptance=new_replay.source, order="a warm-up run of each code (not rated), then rounds "
                  "alternating which code runs first", runs=runs, summary=summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary))
    return result


_KEPT = ("tokens_per_s", "steady_tokens_per_s", "tokens_per_step", "steps", "sparse_steps", "mean_attended",
         "seconds", "peak_gib", "backend")


def _summary(runs: list[dict]) -> dict:
    """Per code the median of its timed runs; new / old; whether both did the same steps."""
    out = {}
    for code in ("old", "new"):
        timed = [r for r in runs if r["code"] == code and not r["warmup"]]
        out[code] = {key: statistics.median(r[key] for r in timed) for key in ("tokens_per_s", "steady_tokens_per_s")
                     if all(r.get(key) is not None for r in timed)}
        out[code]["runs_tokens_per_s"] = [round(r["tokens_per_s"], 1) for r in timed]
    out["ratio"] = out["new"]["tokens_per_s"] / out["old"]["tokens_per_s"]
    steady = [out[c].get("steady_tokens_per_s") for c in ("old", "new")]
    out["steady_ratio"] = steady[1] / steady[0] if all(steady) else float("nan")
    out["within_tolerance"] = abs(out["ratio"] - 1) <= TOLERANCE
    work = {(r["steps"], round(r["tokens_per_step"], 6), r["sparse_steps"]) for r in runs}
    out["same_work"] = len(work) == 1
    return out


def _head() -> str:
    """The working tree's commit (and whether it has changes), or "unknown" without git."""
    try:
        head = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here)"
    return head + (" + uncommitted changes" if dirty else "")


if __name__ == "__main__":
    main()
