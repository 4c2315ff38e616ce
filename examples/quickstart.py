"""Quickstart: ask an Instruct model about a long text, with Dustin and with stock generate(), and time both.

    python examples/quickstart.py           # the offline Qwen2.5-Coder 1.5B + 0.5B Instruct pair, fetched on first use
    python examples/quickstart.py --tiny    # random-weight tiny models: seconds on a CPU, nothing to download

The README's usage section is this file's code below the docstring (a test keeps them equal).
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import dustin_hf
from dustin_lab.models import fetch_pair  # the lab (pip install -e ./lab): the offline pair, books, tiny models
from dustin_lab.texts import load_text
from dustin_lab.tiny import tiny_pair

parser = argparse.ArgumentParser(
    description="Ask an Instruct model about a long text: stock generate(), then Dustin. "
    "Without --tiny it fetches the offline Qwen2.5-Coder pair first (4.6 GB)."
)
parser.add_argument("--tiny", action="store_true", help="random-weight tiny models: seconds, nothing to download")
args, _ = parser.parse_known_args()  # known args only: pasted into a notebook, the kernel's own arguments pass
target_dir, draft_dir = tiny_pair() if args.tiny else fetch_pair()  # or any two model folders
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
tok = AutoTokenizer.from_pretrained(target_dir)
model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device)
draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(device)
tok.chat_template = tok.chat_template or "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # tiny: none

question = load_text("emma")[:12_000] + "\n\nThat was the opening of a novel. In a few sentences, who is Emma?"
batch = tok.apply_chat_template(
    [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
).to(device)  # ~2,900 tokens: sparse
greedy = dict(max_new_tokens=64, do_sample=False)

start = time.perf_counter()
stock = model.generate(**batch, **greedy)  # transformers' own generate(), for the timing
stock_seconds = time.perf_counter() - start

dustin_hf.patch(model)  # the one line
start = time.perf_counter()
out = model.generate(
    **batch, **greedy, assistant_model=draft, cache_implementation="dustin", return_dict_in_generate=True
)
dustin_seconds = time.perf_counter() - start

n = batch["input_ids"].shape[1]  # the new tokens follow the prompt's n
print("stock: ", tok.decode(stock[0, n:], skip_special_tokens=True))
print("Dustin:", tok.decode(out.sequences[0, n:], skip_special_tokens=True))  # sparse mode may part at a near-tie
print(
    f"seconds: stock generate() {stock_seconds:.1f}, Dustin {dustin_seconds:.1f}, each reading a {n}-token prompt "
    "(on a CPU that forward is most of both; Dustin pays on a GPU at long contexts and large batches)"
)
cache = out.cache if hasattr(out, "cache") else out.past_key_values  # `cache` from transformers 5.24
print({k: cache.stats[k] for k in ("sparse_steps", "dense_steps", "mean_attended", "mean_accepted_per_step")})
