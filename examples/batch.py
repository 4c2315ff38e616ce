"""A left-padded batch of prompts of different lengths, generated with Dustin in one call.

    python examples/batch.py           # the offline Qwen2.5-Coder 1.5B + 0.5B pair
    python examples/batch.py --tiny    # random-weight tiny models (seconds)

Each row accepts its own number of drafts per step and stops at its own EOS or ``max_new_tokens``;
rows never wait for each other and never read each other's cache. A row shorter than
``min_context`` is verified densely, the others sparsely, in the same step.
"""

import argparse

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
tok.padding_side = "left"  # pad on the left: the prompts end together

dustin_hf.patch(model, dustin_hf.DustinConfig(budget=256, min_context=1024))
prompts = [load_text("alice")[:n] for n in (600, 6_000, 12_000)]  # short (dense), long, longer
batch = tok(prompts, return_tensors="pt", padding=True).to(device)  # input_ids and attention_mask
out = model.generate(
    **batch,
    assistant_model=draft,
    cache_implementation="dustin",
    max_new_tokens=32,
    do_sample=False,
    return_dict_in_generate=True,
)
width = batch["input_ids"].shape[1]
for row, mask in enumerate(batch["attention_mask"]):
    print(
        f"row {row}, {int(mask.sum())} prompt tokens:",
        tok.decode(out.sequences[row, width:], skip_special_tokens=True),
    )
cache = out.cache if hasattr(out, "cache") else out.past_key_values  # `cache` from transformers 5.24
print({k: cache.stats[k] for k in ("sparse_steps", "dense_steps", "mean_attended", "mean_accepted_per_step")})
