"""The sm_90 PTX of the decode loop's headline Triton launches, hashed, on a simulated H200 (no GPU needed).

Each headline launch is made through the package's public calls at its defaults, on an H200 that
``tests/kernel_ptx.py`` simulates (132 SMs, 227 KiB of shared memory a block, sm_90: the package sizes its
grids, picks its tiles and launches as programmatic dependents as it would there), caught, compiled for
sm_90 without line information (so the PTX depends on the generated code, not on where the source sits)
and hashed:

* verification of the Qwen2.5-72B layout (64 q / 8 kv heads of 128, batch 16, 32k context, gamma 4,
  bf16): sparse over a budget of 512, and dense;
* the 0.5B draft's decode-step attention (14 q / 2 kv heads of 64, batch 16, one query over 512 + 8
  selected positions) and its split merge;
* scoring (passes 1 and 2: the 72B target layer, the three draft layers), selection's two launches;
* ``skinny_linear`` and ``gated_linear`` at the 7B and 0.5B decode shapes (16 rows), the head argmax
  over 152064 logits at 16 and 80 rows, RMSNorm (alone and after the residual add), rotary, rotary + K/V
  write, K/V write, SiLU-mul.

Prints one JSON object: the command, the versions, and per launch its label, kernel, constexprs and PTX
sha256. ``--compare OTHER.json`` adds another report's hashes (say, of an older commit's package, run with
``PYTHONPATH`` pointing at its tree) and whether every launch's PTX is the same.

    python benchmarks/ptx_report.py > head.json
    PYTHONPATH=../old-tree python benchmarks/ptx_report.py > base.json
    python benchmarks/ptx_report.py --compare base.json --out benchmarks/results/ptx_sm90_headline.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # no .loc/.file: the PTX is the generated code alone
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="ptx_report_"))  # compiled here, not reused

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_ptx import H200, compile_sm90, launches_on, require_cuda_compiler  # noqa: E402

BATCH, CONTEXT, GAMMA, BUDGET, VOCAB = 16, 32768, 4, 512, 152064
BF16 = torch.bfloat16


def _empty(*shape, dtype=BF16):
    return torch.empty(*shape, device="cuda", dtype=dtype)


def _verification():
    from dustin_hf.kernels import verify_attention

    q = _empty(BATCH, GAMMA + 1, 64, 128)
    cache = _empty(BATCH, CONTEXT + GAMMA + 1, 8, 128)
    seqlens = _empty(BATCH, dtype=torch.int32)
    indices = _empty(BATCH, BUDGET, dtype=torch.int32)
    verify_attention(q, cache, cache, seqlens, softmax_scale=128**-0.5, indices=indices, num_indices=seqlens,
                     backend="triton")
    verify_attention(q, cache, cache, seqlens, softmax_scale=128**-0.5, max_seqlen_k=CONTEXT + GAMMA + 1,
                     backend="triton")


def _draft_decode():
    from dustin_hf.kernels import verify_attention

    cache = _empty(BATCH, CONTEXT + 8, 2, 64)
    seqlens = _empty(BATCH, dtype=torch.int32)
    verify_attention(_empty(BATCH, 1, 14, 64), cache, cache, seqlens, softmax_scale=64**-0.5,
                     indices=_empty(BATCH, BUDGET + 8, dtype=torch.int32), num_indices=seqlens, backend="triton")


def _scoring():
    from dustin_hf import scoring

    seqlens = _empty(BATCH, dtype=torch.int32)
    scoring.target_history_scores(_empty(BATCH, 8, 128), _empty(BATCH, CONTEXT + GAMMA + 1, 8, 128), seqlens,
                                  tuple(range(8)), 8, 128**-0.5, CONTEXT, backend="triton")
    scoring.draft_lookahead_scores([_empty(BATCH, GAMMA, 7, 64)] * 3, [_empty(BATCH, CONTEXT + GAMMA + 1, 2, 64)] * 3,
                                   seqlens, (tuple(range(7)),) * 3, 7, 64**-0.5, CONTEXT, backend="triton")


def _selection():
    from dustin_hf.kernels.triton_select import select_sparse_triton

    scores = _empty(BATCH, CONTEXT, dtype=torch.float32)
    select_sparse_triton(scores, scores, _empty(BATCH, dtype=torch.int32), sink=4, recent=16, share=246, fill=246)


def _projections():
    from dustin_hf.kernels.triton_gemm import gated_linear, skinny_linear

    for hidden, qkv, intermediate in ((896, 1152, 4864), (3584, 4608, 18944)):  # Qwen2.5-0.5B, Qwen2.5-7B
        x = _empty(BATCH, hidden)
        skinny_linear(x, _empty(qkv, hidden), _empty(qkv))
        skinny_linear(x, _empty(hidden, hidden))
        gated_linear(x, _empty(2 * intermediate, hidden))
        skinny_linear(_empty(BATCH, intermediate), _empty(hidden, intermediate))  # split K


def _argmax():
    from dustin_hf.kernels.triton_argmax import argmax_triton

    for rows in (BATCH, BATCH * (GAMMA + 1)):
        argmax_triton(_empty(rows, VOCAB))


def _elementwise():
    from dustin_hf.kernels.triton_cache import write_kv_triton
    from dustin_hf.kernels.triton_fused import (add_rms_norm_triton, apply_rotary_triton, rms_norm_triton,
                                                rotary_write_kv_triton, silu_mul_triton)

    x = _empty(BATCH, 1, 896)
    rms_norm_triton(x, _empty(896), 1e-6)
    add_rms_norm_triton(x, x, _empty(896), 1e-6)
    q, k = _empty(BATCH, 1, 14, 64), _empty(BATCH, 1, 2, 64)
    cos = _empty(BATCH, 1, 64)
    cache = _empty(BATCH, CONTEXT + 8, 2, 64)
    apply_rotary_triton(q.transpose(1, 2), k.transpose(1, 2), cos, cos)
    rotary_write_kv_triton(q, k, k, cos, cos, cache, cache, _empty(BATCH, 1, dtype=torch.int64), 0)
    states = _empty(BATCH, 2, GAMMA + 1, 64)
    write_kv_triton(states, states, cache, cache, _empty(BATCH, GAMMA + 1, dtype=torch.int64), 0)
    silu_mul_triton(_empty(BATCH, 1, 2 * 4864))


HEADLINE = {"verification": _verification, "draft_decode": _draft_decode, "scoring": _scoring,
            "selection": _selection, "projections": _projections, "argmax": _argmax, "elementwise": _elementwise}


def report() -> dict:
    import dustin_hf
    import triton

    package = Path(dustin_hf.__file__).resolve().parent
    commit = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    launches = []
    for group, run in HEADLINE.items():
        for i, launch in enumerate(launches_on(H200, run)):
            ptx = compile_sm90(launch)
            launches.append(dict(label=f"{group}/{i}", kernel=launch.name, constexprs=launch.constexprs,
                                 options=launch.options, sha256=hashlib.sha256(ptx.encode()).hexdigest()))
    path = os.environ.get("PYTHONPATH")
    command = " ".join(([f"PYTHONPATH={path}"] if path else []) + ["python", *sys.argv])
    return dict(command=command, package=str(package), commit=commit,
                gpu=f"simulated {H200.name}: sm_{H200.capability[0]}{H200.capability[1]}, {H200.sm_count} SMs, "
                    f"{H200.max_shared_mem} bytes of shared memory a block",
                versions=dict(triton=triton.__version__, torch=torch.__version__), launches=launches)


def compare(head: dict, other: dict) -> dict:
    """Both reports' hashes by label, and whether each launch (kernel, constexprs, PTX) is the same in both."""
    head = json.loads(json.dumps(head, default=str))  # as the other report was read back
    mine, theirs = ({launch["label"]: launch for launch in r["launches"]} for r in (head, other))
    differ = sorted(label for label in mine.keys() | theirs.keys() if mine.get(label) != theirs.get(label))
    return dict(equal=not differ, differ=differ, other=other, head=head)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", metavar="OTHER.json", help="another report to compare the hashes with")
    parser.add_argument("--out", help="save the JSON here as well")
    args = parser.parse_args(argv)
    require_cuda_compiler()
    result = report()
    if args.compare:
        result = compare(result, json.loads(Path(args.compare).read_text()))
    text = json.dumps(result, indent=1, default=str)  # constexprs may be Triton dtypes
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
