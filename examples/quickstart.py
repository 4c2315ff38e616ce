"""Quickstart: patch a target, continue one long prompt with Dustin, print the text and the stats.

    python examples/quickstart.py           # the offline Qwen2.5-Coder 1.5B + 0.5B pair, fetched on first use
    python examples/quickstart.py --tiny    # random-weight tiny models: seconds on a CPU, nothing to download

The README's usage section is this file's code below the docstring (a test keeps them equal).
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dustin_hf
from dustin_lab.models import fetch_pair
from dustin_lab.texts import load_text
from dustin_lab.tiny import tiny_pair

target_dir, draft_dir = tiny_pair() if "--tiny" in sys.argv else fetch_pair()  # or any two model folders
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tok = AutoTokenizer.from_pretrained(target_dir)
model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device)
draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(device)

dustin_hf.patch(model)  # the one line
prompt = load_text("emma")[:12_000] + "\n\nIn one paragraph, what has happened so far?"
batch = tok(prompt, return_tensors="pt").to(device)  # about 2,900 tokens: past min_context, so sparse
out = model.generate(**batch, assistant_model=draft, cache_implementation="dustin",
                     max_new_tokens=64, do_sample=False, return_dict_in_generate=True)
print(tok.decode(out.sequences[0, batch["input_ids"].shape[1]:], skip_special_tokens=True))
cache = out.cache if hasattr(out, "cache") else out.past_key_values  # `cache` from transformers 5.24
print({k: cache.stats[k] for k in ("sparse_steps", "dense_steps", "mean_attended", "mean_accepted_per_step")})
