"""A/B for this branch (run on the H200 from the repo root, then drop the file before merging): the fused MLP's skinny down projection on vs off, one process, alternating."""
import glob
import sys

import torch

sys.path.insert(0, "benchmarks")  # e2e.py
import e2e  # noqa: E402
import dustin_hf  # noqa: E402
from dustin_hf import fused  # noqa: E402

dev = [torch.device("cuda:0")]
target = e2e.build_model("7b", dev, torch.bfloat16)
draft = e2e.build_model("0.5b", dev, torch.bfloat16)
dustin_hf.patch(target)
replay = e2e.Replay.load(sorted(glob.glob("benchmarks/traces/*teacher-forced_ctx*_g4_dustin-sparse-draft_b512.json")))
for rows in (16, 0, 16, 0):
    fused._SKINNY_ROWS = rows
    r = e2e.run_speculative(target, draft, 16, 32768, "dustin_sparse_draft", replay, torch.bfloat16)
    print(f"skinny_rows={rows} tok/s {r['tokens_per_s']:.1f} steady {r['steady_tokens_per_s']:.1f}", flush=True)
