"""Calibrate the scoring heads on book windows (a short time limit), save the profile, patch with it.

    python examples/calibrate_then_patch.py           # the offline Qwen2.5-Coder 1.5B + 0.5B pair (minutes)
    python examples/calibrate_then_patch.py --tiny    # random-weight tiny models (seconds)
    python examples/calibrate_then_patch.py --out profile.json    # keep the profile here

Calibration searches the target layer and heads, the draft layers and heads and ``draft_share``
(``m``) that recover the most of the target's full attention under the budget, on verification-like
steps sampled from long texts; ``dustin-hf calibrate`` runs the same search from the command line.
The profile is a JSON file: ``dustin_hf.patch(model, "profile.json")`` loads it. It is written to
``--out PATH`` when given, else into a temporary folder (the example writes nothing into the working
directory).
"""

import argparse
import tempfile
from pathlib import Path

import torch

import dustin_hf
from dustin_hf.profiles import write_profile
from dustin_lab.calibrate import calibrate
from dustin_lab.models import fetch_pair
from dustin_lab.pair import load_pair
from dustin_lab.settings import CalibrationSettings
from dustin_lab.texts import token_window
from dustin_lab.tiny import tiny_pair

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tiny", action="store_true", help="random-weight tiny models (seconds)")
parser.add_argument("--out", type=Path, help="write the profile here (default: a temporary folder)")
args = parser.parse_args()
tiny = args.tiny
target_dir, draft_dir = tiny_pair() if tiny else fetch_pair()
pair = load_pair(target_dir, draft_dir)  # checks that both folders share a tokenizer, then loads both models
if tiny:  # short windows and small budgets for the tiny models
    settings = CalibrationSettings(
        books=("alice",),
        context=640,
        min_position=320,
        steps_per_book=4,
        budgets=(64, 128),
        profile_budget=128,
        time_limit=30,
    )
else:
    settings = CalibrationSettings(books=("mobydick",), time_limit=600)  # seconds for collection and search
result = calibrate(pair, settings)
config = dustin_hf.DustinConfig(**result.pop("config"))
profile = args.out or Path(tempfile.mkdtemp()) / "profile.json"
path = write_profile(profile, config, result.pop("draft_share_fraction"), **result)
print(
    f"recovery on {len(result['texts'])} steps: calibrated {result['recovery']['mean']:.3f}, "
    f"default heads {result['default_recovery']['mean']:.3f}; profile written to {path}"
)

dustin_hf.patch(pair.target, path)  # the calibrated heads and draft share, at the profile's budget
prompt = token_window(pair.tokenizer, "emma", 1024 if tiny else 4096)[None].to(pair.device)
cache_config = {"min_context": 512} if tiny else {}
out = pair.target.generate(
    prompt,
    attention_mask=torch.ones_like(prompt),
    assistant_model=pair.draft,
    cache_implementation="dustin",
    cache_config=cache_config,
    max_new_tokens=32,
    do_sample=False,
    return_dict_in_generate=True,
)
cache = out.cache if hasattr(out, "cache") else out.past_key_values  # `cache` from transformers 5.24
print(pair.tokenizer.decode(out.sequences[0, prompt.shape[1] :], skip_special_tokens=True))
print({k: cache.stats[k] for k in ("sparse_steps", "dense_steps", "mean_attended", "mean_accepted_per_step")})
