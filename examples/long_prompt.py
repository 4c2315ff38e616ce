"""One long prompt, two ways: classic speculative decoding (dense verification) beside Dustin, with timings and stats.

    python examples/long_prompt.py           # the offline Qwen2.5-Coder 1.5B + 0.5B pair (minutes on a CPU)
    python examples/long_prompt.py --tiny    # random-weight tiny models (seconds)

Both runs are plain ``model.generate(..., assistant_model=draft)`` calls on the same patched target;
the Dustin run adds ``cache_implementation="dustin"`` and, for this call only, ``cache_config``.
Greedy dense speculative decoding returns exactly the target's greedy text; Dustin verifies each
step against ``budget`` selected cached positions instead of all of them, so its text may part
from the dense one where two candidates were close (by design, not an error).
"""

import argparse
import time

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
draft.generation_config.num_assistant_tokens = 4
draft.generation_config.assistant_confidence_threshold = 0.0  # always draft 4: the same γ for both runs

dustin_hf.patch(model)
batch = tok(load_text("mobydick")[:12_000], return_tensors="pt").to(device)
prompt_len = batch["input_ids"].shape[1]
runs = {
    "dense speculative": {},  # transformers' own assisted decoding
    "Dustin, budget 256": {"cache_implementation": "dustin", "cache_config": {"budget": 256}},
}
texts = {}
for name, extra in runs.items():
    start = time.perf_counter()
    out = model.generate(
        **batch, assistant_model=draft, max_new_tokens=48, do_sample=False, return_dict_in_generate=True, **extra
    )
    seconds = time.perf_counter() - start
    texts[name] = out.sequences[0, prompt_len:].tolist()
    print(f"== {name}: {len(texts[name])} tokens in {seconds:.1f} s (prompt of {prompt_len} tokens read included)")
    print(tok.decode(texts[name], skip_special_tokens=True))
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # `cache` from transformers 5.24
    if hasattr(cache, "stats"):  # Dustin's cache says what verification did
        s = cache.stats
        print(
            f"   sparse steps {s['sparse_steps']}, dense steps {s['dense_steps']}, {s['mean_attended']:.0f} cached "
            f"positions read per sparse step, {s['mean_accepted_per_step']:.2f} drafts kept per step, "
            f"decode {s['decode_seconds']:.1f} s after a prefill of {s['prefill_seconds']:.1f} s"
        )

dense, sparse = texts.values()
same = next((i for i, (a, b) in enumerate(zip(dense, sparse)) if a != b), min(len(dense), len(sparse)))
print(f"identical before the first difference: {same} of {min(len(dense), len(sparse))} tokens")
