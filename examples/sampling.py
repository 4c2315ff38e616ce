"""Sampling with Dustin: ``do_sample=True`` with temperature and top-p, the speculative rejection rule per row.

    python examples/sampling.py           # the offline Qwen2.5-Coder 1.5B + 0.5B pair
    python examples/sampling.py --tiny    # random-weight tiny models (seconds)

A draft token is kept with probability min(1, p/q) (p: the target's probability of it after
temperature and top-p, q: the draft's), and a rejected one is replaced by a sample from the
normalised max(0, p - q); so with a budget that covers the context the output follows exactly the
target's distribution. Sparse steps sample from the target's distribution as verified sparsely.
"""

import argparse

import torch

import dustin_hf
from dustin_lab.models import fetch_pair
from dustin_lab.pair import load_pair
from dustin_lab.texts import load_text
from dustin_lab.tiny import tiny_pair

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--tiny", action="store_true", help="random-weight tiny models (seconds)")
# both folders checked, one tokenizer, bfloat16 on CUDA and float32 on a CPU (the quickstart spells this out)
pair = load_pair(*(tiny_pair() if parser.parse_args().tiny else fetch_pair()))
tok, model, draft, device = pair.tokenizer, pair.target, pair.draft, pair.device

dustin_hf.patch(model)
batch = tok(load_text("prideprejudice")[:12_000], return_tensors="pt").to(device)
torch.manual_seed(0)  # the same seed gives the same samples
for sample in range(2):
    out = model.generate(
        **batch,
        assistant_model=draft,
        cache_implementation="dustin",
        max_new_tokens=48,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        return_dict_in_generate=True,
    )
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # `cache` from transformers 5.24
    print(
        f"sample {sample} ({cache.stats['sparse_steps']} sparse steps, "
        f"{cache.stats['mean_accepted_per_step']:.2f} drafts kept per step):"
    )
    print(tok.decode(out.sequences[0, batch["input_ids"].shape[1] :], skip_special_tokens=True))
