"""A seeded fuzz of dustin_hf through its public path: random model pairs, batches and settings, and the invariants.

Every case is drawn from ``(seed, index)`` alone (:func:`draw_case`), so a case reads the same whatever else runs,
and is run through ``dustin_hf.patch`` and ``model.generate(..., assistant_model=draft, cache_implementation="dustin",
cache_config={...})`` exactly as a user would (:func:`check_case`). The invariants (issue #24):

- ``alone``: with a budget covering the context and greedy decoding, every row equals that row's prompt, unpadded,
  decoded alone by stock greedy ``generate()`` with the same processors (no assistant); with right padding, which
  stock reads as part of the row (its positions restart after the padding), every row equals stock greedy on the
  same padded batch;
- ``well_formed``: the output keeps the input layout, a row ends at its first EOS (pad after it) or after exactly
  ``max_new_tokens``, never before ``min_new_tokens``;
- ``reads``: every sparse verification reads, per row and (non-dense) layer, at most ``budget`` positions of its
  own cache, sorted and distinct, and rows the documentation calls dense (context within the budget or below
  ``min_context``) read exactly their context; ``stats["mean_attended"]`` stays within the same bound; sparse steps
  happen once a row's context is past both;
- ``mates``: a row's tokens do not change when its batch-mates do: the batch again with every other row replaced
  by fresh random tokens of the same length (same seed when sampling), and (greedy, left padding) the row decoded
  alone by the same Dustin settings. ``calibration="prompt"`` chooses one scoring configuration for the whole
  batch from its longest prompts, so its rows are exempt (the documented exception).

Sizes: ``DUSTIN_FUZZ_CASES`` cases in all (default :data:`CI_CASES`), split over the seeds of ``DUSTIN_FUZZ_SEEDS``
(default ``0,1``); case ``i`` has a covering budget when ``i % 8 < 5`` (so 800 cases are 500 covering and 300
small-budget ones). ``DUSTIN_FUZZ_SEED`` + ``DUSTIN_FUZZ_CASE`` run one case. From the command line,
``python tests/fuzz.py --seed S --case I [--shrink]`` runs one case and (``--shrink``) searches for a smaller case
that fails the same invariant; ``--json '{...}'`` runs a case given as printed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import sys
import traceback
from dataclasses import dataclass

import torch
from tiny_models import PAD, VOCAB, noisy_copy, tiny_model
from transformers import AttentionInterface, PreTrainedTokenizerFast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import dustin_hf
from dustin_hf import DustinConfig
from dustin_hf.compat import CACHE_KWARG
from dustin_hf.config import resolve

__all__ = [
    "CI_CASES",
    "Case",
    "case_ids",
    "check_case",
    "draw_case",
    "from_json",
    "report",
    "reproduction",
    "shared_tokenizer",
    "shrink",
]

CI_CASES = 128
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # mistral with sliding_window=None (tiny_models)
DRAFT_KINDS = ("independent", "clone", "small_vocab")
_ATTENTION = "dustin"


@dataclass(frozen=True)
class Case:
    """All drawn parameters of one case (:meth:`to_json` prints it, :func:`from_json` reads it back)."""

    seed: int
    index: int
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    draft_kind: str  # "independent": its own random model; "clone": noisy copy; "small_vocab": fewer embedding rows
    draft_family: str
    draft_layers: int
    draft_hidden: int
    draft_heads: int
    draft_kv_heads: int
    draft_vocab: int  # VOCAB unless small_vocab (then passed with tokenizer=tok, assistant_tokenizer=tok)
    noise: float  # clone / small_vocab-from-clone: weight noise; 0 for an independent draft
    lengths: tuple[int, ...]  # prompt length per row
    prompt_vocab: int  # prompt ids are drawn from [0, prompt_vocab) (PAD excluded)
    padding: str  # "left" or "right"
    gamma: int
    threshold: float | None  # the draft's assistant_confidence_threshold; None: transformers' default
    max_new_tokens: int
    eos: tuple[int, ...]  # eos_token_id (one id or a list); () for none
    processors: tuple[tuple[str, object], ...]  # generate() kwargs of the drawn logits processors
    do_sample: bool
    sampling: tuple[tuple[str, object], ...]  # temperature / top_k / top_p when sampling
    covering: bool  # the budget covers every row's context for the whole generation
    budget: int
    sink_tokens: int
    recent_tokens: int
    draft_share: int | None
    min_context: int
    sparse_draft: bool
    dense_layers: tuple[int, ...]
    calibration: str
    subject: int  # the row whose batch-mates are replaced
    selection: str = "dustin"  # Dustin's set, or "verify" (the selection layers: the library's default)

    @property
    def name(self) -> str:
        return f"s{self.seed}-c{self.index}"

    def cache_config(self) -> dict:
        fields = dict(
            budget=self.budget,
            sink_tokens=self.sink_tokens,
            recent_tokens=self.recent_tokens,
            min_context=self.min_context,
            sparse_draft=self.sparse_draft,
            dense_layers=self.dense_layers,
            calibration=self.calibration,
            selection=self.selection,
        )
        if self.draft_share is not None:
            fields["draft_share"] = self.draft_share
        return fields

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


def from_json(text: str) -> Case:
    data = json.loads(text)
    for name in ("lengths", "eos", "dense_layers"):
        data[name] = tuple(data[name])
    for name in ("processors", "sampling"):
        data[name] = tuple((k, _tupled(v)) for k, v in data[name])
    return Case(**data)


def _tupled(value):
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


# ------------------------------------------------------------------------------------------------ the draw
def _layout(rng: random.Random) -> tuple[int, int, int]:
    """(hidden, heads, kv_heads) with head_dim >= 8 and kv_heads dividing heads (GQA, MQA or MHA)."""
    hidden = rng.choice((32, 64))
    heads = rng.choice([h for h in (2, 4, 8) if hidden // h >= 8])
    kv_heads = rng.choice([k for k in (1, 2, 4, 8) if k <= heads and heads % k == 0])
    return hidden, heads, kv_heads


def draw_case(seed: int, index: int) -> Case:
    """The case numbered ``index`` of ``seed``: a function of the two numbers only."""
    rng = random.Random(f"dustin-fuzz:{seed}:{index}")
    covering = index % 8 < 5
    models = _draw_models(rng)
    batch, gamma = rng.randint(1, 4), rng.randint(1, 6)
    decoding = _draw_decoding(rng, min(models["prompt_vocab"], models["draft_vocab"]))
    budget = (_draw_covering_budget if covering else _draw_small_budget)(rng, batch, gamma)
    return Case(
        seed=seed,
        index=index,
        **models,
        gamma=gamma,
        **decoding,
        covering=covering,
        **budget,
        padding="right" if batch > 1 and rng.random() < 0.2 else "left",
        subject=rng.randrange(batch),
    )


def _draw_models(rng: random.Random) -> dict:
    """The target's family and layout, the draft's kind and layout, and the range of the prompts' ids."""
    family = rng.choice(FAMILIES)
    hidden, heads, kv_heads = _layout(rng)
    layers = rng.randint(1, 3)
    kind = rng.choice(DRAFT_KINDS)
    draft_vocab = VOCAB - rng.randint(1, 24) if kind == "small_vocab" else VOCAB
    if kind == "clone" or (kind == "small_vocab" and rng.random() < 0.5):  # a noisy copy (cut to draft_vocab)
        d_family, d_layers, (d_hidden, d_heads, d_kv) = family, layers, (hidden, heads, kv_heads)
        noise = rng.choice((0.001, 0.01, 0.05, 0.2))
    else:
        d_family, d_layers, (d_hidden, d_heads, d_kv) = rng.choice(FAMILIES), rng.randint(1, 3), _layout(rng)
        noise = 0.0
    # ids the shared tokenizer never produces (the target's padding rows) in about a third of the small-vocabulary
    # cases
    prompt_vocab = PAD if kind != "small_vocab" or rng.random() < 0.3 else draft_vocab
    return dict(
        family=family,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        draft_kind=kind,
        draft_family=d_family,
        draft_layers=d_layers,
        draft_hidden=d_hidden,
        draft_heads=d_heads,
        draft_kv_heads=d_kv,
        draft_vocab=draft_vocab,
        noise=noise,
        prompt_vocab=prompt_vocab,
    )


def _draw_decoding(rng: random.Random, token_range: int) -> dict:
    """Threshold, greedy or sampling, EOS ids and logits processors (ids below ``token_range``)."""
    threshold = rng.choice((0.0, 0.0, None, round(rng.uniform(0.05, 0.95), 2), round(rng.uniform(0.05, 0.95), 2)))
    do_sample = rng.random() < 0.35
    sampling = ()
    if do_sample:
        sampling = (("temperature", round(rng.uniform(0.5, 1.5), 2)),)
        if rng.random() < 0.3:
            sampling += (("top_k", rng.choice((5, 20))),)
        if rng.random() < 0.3:
            sampling += (("top_p", 0.9),)
    eos = ()
    if rng.random() < 0.7:
        eos = tuple(rng.sample(range(token_range), rng.choice((1, 1, 2, 3, 4))))
    return dict(
        threshold=threshold,
        do_sample=do_sample,
        sampling=sampling,
        eos=eos,
        processors=_draw_processors(rng, token_range, bool(eos)),
    )


def _draw_covering_budget(rng: random.Random, batch: int, gamma: int) -> dict:
    """Short prompts and a budget past every row's context for the whole generation (every step dense)."""
    lengths = tuple(rng.choice((rng.randint(1, 8), rng.randint(1, 80))) for _ in range(batch))
    max_new = rng.randint(4, 16)
    budget = max(lengths) + max_new + gamma + 1 + rng.randint(0, 16)
    sink, recent = rng.randint(0, 4), rng.randint(0, 16)
    return dict(
        lengths=lengths,
        max_new_tokens=max_new,
        budget=budget,
        **_windows(sink, recent, budget),
        min_context=rng.randint(0, budget),
        draft_share=None,
        dense_layers=(),
        calibration="none",
        sparse_draft=rng.random() < 0.5,
        selection=rng.choice(("dustin", "verify")),
    )


def _draw_small_budget(rng: random.Random, batch: int, gamma: int) -> dict:
    """A budget of 8-64 and ragged prompts, at least one of them past the budget and ``min_context``."""
    budget = rng.randint(8, 64)
    sink = rng.randint(0, 4)
    recent = rng.randint(0, min(16, budget - sink))
    min_context = rng.randint(0, budget) if rng.random() < 0.8 else rng.randint(budget + 1, 3 * budget)
    longest = min(360, max(6 * budget, min_context + 40))
    lengths = [rng.choice((rng.randint(1, budget), rng.randint(budget + 1, longest))) for _ in range(batch)]
    lengths[rng.randrange(batch)] = rng.randint(max(budget, min_context) + 1, longest)  # some row goes sparse
    max_new = rng.randint(6, 20)
    calibration = "prompt" if rng.random() < 0.08 and sink + recent < budget else "none"
    free = budget - sink - recent
    draft_share = rng.randint(0, free) if calibration == "none" and rng.random() < 0.3 else None
    dense_layers = (rng.choice((0, -1)),) if rng.random() < 0.15 else ()
    return dict(
        lengths=tuple(lengths),
        max_new_tokens=max_new,
        budget=budget,
        **_windows(sink, recent, budget),
        min_context=min_context,
        draft_share=draft_share,
        dense_layers=dense_layers,
        calibration=calibration,
        sparse_draft=rng.random() < 0.5,
        selection=rng.choice(("dustin", "verify")),
    )


def _windows(sink: int, recent: int, budget: int) -> dict:
    sink = min(sink, budget)
    return dict(sink_tokens=sink, recent_tokens=min(recent, budget - sink))


def _draw_processors(rng: random.Random, token_range: int, has_eos: bool) -> tuple[tuple[str, object], ...]:
    drawn = []
    if rng.random() < 0.2:
        drawn.append(("repetition_penalty", round(rng.uniform(1.05, 2.0), 2)))
    if rng.random() < 0.2:
        drawn.append(("no_repeat_ngram_size", rng.choice((2, 3))))
    if has_eos and rng.random() < 0.3:
        drawn.append(("min_new_tokens", rng.randint(1, 5)))
    if rng.random() < 0.2:
        words = [tuple(rng.sample(range(token_range), rng.choice((1, 2)))) for _ in range(rng.randint(1, 3))]
        drawn.append(("bad_words_ids", tuple(words)))
    if rng.random() < 0.2:
        drawn.append(("suppress_tokens", tuple(rng.sample(range(token_range), rng.randint(1, 4)))))
    return tuple(drawn)


def case_ids() -> list[tuple[int, int]]:
    """The ``(seed, index)`` pairs this run draws, from the environment (see the module docstring)."""
    if os.environ.get("DUSTIN_FUZZ_CASE") is not None:
        return [(int(os.environ.get("DUSTIN_FUZZ_SEED", "0")), int(os.environ["DUSTIN_FUZZ_CASE"]))]
    total = int(os.environ.get("DUSTIN_FUZZ_CASES", CI_CASES))
    seeds = [int(s) for s in os.environ.get("DUSTIN_FUZZ_SEEDS", "0,1").split(",") if s.strip()]
    per_seed = -(-total // len(seeds))
    return [(seed, index) for seed in seeds for index in range(per_seed)]


def reproduction(case: Case) -> str:
    return (
        f"DUSTIN_FUZZ_SEED={case.seed} DUSTIN_FUZZ_CASE={case.index} "
        f"python -m pytest tests/test_fuzz.py -k {case.name}"
    )


# ------------------------------------------------------------------------------------------------ models, prompts
def shared_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of ``size`` tokens, passed as ``tokenizer=tok, assistant_tokenizer=tok``."""
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(size)}, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")


def build_pair(case: Case):
    """The target and draft of ``case`` (deterministic), the draft's γ and threshold set as a user would."""
    seed = case.seed * 100_003 + case.index
    target = tiny_model(
        case.family, layers=case.layers, hidden=case.hidden, heads=case.heads, kv_heads=case.kv_heads, seed=seed
    )
    if case.draft_kind == "small_vocab":
        # as a real pair padded differently (Qwen2.5-7B vs 0.5B): the target's extra rows are never the argmax
        target.lm_head.weight.data[case.draft_vocab :] = 0
    if case.noise:
        draft = noisy_copy(target, noise=case.noise, seed=seed + 1)
        if case.draft_vocab < VOCAB:
            draft.resize_token_embeddings(case.draft_vocab)
    else:
        draft = tiny_model(
            case.draft_family,
            layers=case.draft_layers,
            hidden=case.draft_hidden,
            heads=case.draft_heads,
            kv_heads=case.draft_kv_heads,
            seed=seed + 2,
            vocab=case.draft_vocab,
        )
    draft.generation_config.num_assistant_tokens = case.gamma
    draft.generation_config.assistant_confidence_threshold = case.threshold
    return target, draft


def prompts(case: Case, salt: int = 0) -> list[torch.Tensor]:
    """Each row's prompt; ``salt`` != 0 gives fresh contents of the same lengths."""
    out = []
    for b, n in enumerate(case.lengths):
        generator = torch.Generator().manual_seed(case.seed * 1_000_003 + case.index * 1009 + b * 31 + salt * 7919)
        out.append(torch.randint(0, case.prompt_vocab, (n,), generator=generator))
    return out


def pad_batch(rows: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, r in enumerate(rows):
        where = slice(width - r.numel(), width) if side == "left" else slice(0, r.numel())
        ids[b, where], mask[b, where] = r, 1
    return ids, mask


def _generate_kwargs(case: Case) -> dict:
    kwargs = dict(
        max_new_tokens=case.max_new_tokens,
        pad_token_id=PAD,
        do_sample=case.do_sample,
        **dict(case.processors),
        **dict(case.sampling),
    )
    if "bad_words_ids" in kwargs:
        kwargs["bad_words_ids"] = [list(word) for word in kwargs["bad_words_ids"]]
    if "suppress_tokens" in kwargs:
        kwargs["suppress_tokens"] = list(kwargs["suppress_tokens"])
    kwargs["eos_token_id"] = (case.eos[0] if len(case.eos) == 1 else list(case.eos)) if case.eos else None
    return kwargs


# ------------------------------------------------------------------------------------------------ reads observed
@dataclass
class _Reads:
    """Per-row read counts of the target's sparse verification forwards, and what broke the documented bound."""

    budget: int
    min_context: int
    target_modules: set
    violations: list = dataclasses.field(default_factory=list)
    sparse_layer_calls: int = 0  # sparse target layers seen: none while stats count sparse steps is a finding too

    def record(self, module, plan) -> None:
        if id(module) not in self.target_modules or plan is None or not plan.is_sparse:
            return
        layer = module.layer_idx
        if layer in plan.dense_layers:
            return
        self.sparse_layer_calls += 1
        tensors = plan.on(next(module.parameters()).device)
        seqlens = tensors.cache_seqlens.tolist()
        counts = tensors.num_indices.tolist()
        for i, (length, n) in enumerate(zip(seqlens, counts)):
            row = plan.rows.start + i
            dense = length <= self.budget or length < self.min_context
            if plan.full_rows and n >= length:  # read in full through its count, its index row unread
                read = torch.arange(length)
            else:
                read = tensors.indices[i, :n].long()
            if dense and n != length:
                self.violations.append(f"layer {layer} row {row}: a dense row (context {length}) read {n} positions")
            elif not dense and n > self.budget:
                self.violations.append(f"layer {layer} row {row}: read {n} > budget {self.budget} (context {length})")
            elif n > tensors.indices.shape[1] and not (plan.full_rows and n >= length):
                self.violations.append(
                    f"layer {layer} row {row}: {n} entries counted in {tensors.indices.shape[1]} "
                    "columns, not read in full"
                )
            elif n and (int(read.min()) < 0 or int(read.max()) >= length or bool((read.diff() <= 0).any())):
                self.violations.append(f"layer {layer} row {row}: read positions outside [0, {length}) or unsorted")


@contextlib.contextmanager
def _observe_reads(target, case: Case):
    """Wrap the registered ``"dustin"`` attention (transformers' registry) to record what each layer reads."""
    original = ALL_ATTENTION_FUNCTIONS[_ATTENTION]
    reads = _Reads(case.budget, case.min_context, {id(m) for m in target.modules()})

    def observed(module, *args, dustin_plan=None, **kwargs):
        reads.record(module, dustin_plan)
        return original(module, *args, dustin_plan=dustin_plan, **kwargs)

    AttentionInterface.register(_ATTENTION, observed)
    try:
        yield reads
    finally:
        AttentionInterface.register(_ATTENTION, original)


# ------------------------------------------------------------------------------------------------ the checks
def _row_tokens(sequences: torch.Tensor, width: int, b: int, eos: tuple[int, ...]) -> list[int]:
    """Row ``b``'s generated tokens: up to and including its first EOS, else all of them."""
    row = sequences[b, width:].tolist()
    for j, token in enumerate(row):
        if token in eos:
            return row[: j + 1]
    return row


def _first_difference(got: list[int], want: list[int]) -> str:
    at = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    return f"first differs at generated position {at}: got {got} want {want}"


def _dustin(target, draft, case: Case, rows: list[torch.Tensor]):
    """``rows`` padded as the case says, through the public ``generate()``: (input_ids, sequences, stats)."""
    ids, mask = pad_batch(rows, case.padding)
    extra = {}
    if case.draft_vocab != VOCAB:
        tok = shared_tokenizer(case.draft_vocab)
        extra = dict(tokenizer=tok, assistant_tokenizer=tok)
    torch.manual_seed(case.seed * 7 + case.index)
    out = target.generate(
        ids,
        attention_mask=mask,
        assistant_model=draft,
        cache_implementation="dustin",
        cache_config=case.cache_config(),
        return_dict_in_generate=True,
        **_generate_kwargs(case),
        **extra,
    )
    return ids, out.sequences, getattr(out, CACHE_KWARG).stats


def _well_formed(case: Case, ids: torch.Tensor, sequences: torch.Tensor) -> list[str]:
    """The input layout kept; each row ends at its first EOS (then pad) or after exactly max_new_tokens."""
    failures = []
    batch, width = ids.shape
    if sequences.shape[0] != batch or not torch.equal(sequences[:, :width], ids):
        return [f"sequences {tuple(sequences.shape)} do not start with the input {tuple(ids.shape)}"]
    generated = sequences.shape[1] - width
    if not 1 <= generated <= case.max_new_tokens:
        failures.append(f"{generated} generated columns, max_new_tokens={case.max_new_tokens}")
    if int(sequences.min()) < 0 or int(sequences.max()) >= VOCAB:
        failures.append("token ids outside the vocabulary")
    min_new = dict(case.processors).get("min_new_tokens", 0)
    for b in range(batch):
        tokens = _row_tokens(sequences, width, b, case.eos)
        tail = sequences[b, width + len(tokens) :].tolist()
        if len(tokens) < generated and any(t != PAD for t in tail):
            failures.append(f"row {b}: not padding after its EOS: {sequences[b, width:].tolist()}")
        if (not tokens or tokens[-1] not in case.eos) and len(tokens) != case.max_new_tokens:
            failures.append(
                f"row {b}: stopped after {len(tokens)} tokens without EOS "
                f"(max_new_tokens={case.max_new_tokens}): {tokens}"
            )
        if tokens and tokens[-1] in case.eos and len(tokens) <= min_new:  # EOS is banned while fewer are new
            failures.append(f"row {b}: EOS as token {len(tokens)}, min_new_tokens={min_new}")
    return failures


def _read_bound(case: Case, stats: dict, reads: _Reads, selection_layers: tuple[int, ...]) -> list[str]:
    """What the observed reads broke, ``stats["mean_attended"]`` against the bound they imply (a selection layer
    reads the whole cache, as a dense layer does), and sparse steps where the documentation says a row is verified
    sparsely (none with a covering budget)."""
    failures = list(reads.violations[:3])
    if stats["sparse_steps"] and not reads.sparse_layer_calls and len(case.dense_layers) < case.layers:
        failures.append(f"stats count {stats['sparse_steps']} sparse steps, but no target layer read a selection")
    longest = max(case.lengths) + case.max_new_tokens + case.gamma + 1
    cap = case.budget if case.min_context <= case.budget + 1 else max(case.budget, min(longest, case.min_context - 1))
    dense = len({layer % case.layers for layer in case.dense_layers} | set(selection_layers))
    bound = ((case.layers - dense) * cap + dense * longest) / case.layers
    if stats["sparse_steps"] and stats["mean_attended"] > bound + 1e-6:
        failures.append(f"stats mean_attended {stats['mean_attended']:.2f} > bound {bound:.2f}")
    if not case.covering and stats["sparse_steps"] == 0:
        failures.append(
            f"no sparse step, though a row's context ({max(case.lengths)}) is past budget "
            f"{case.budget} and min_context {case.min_context}"
        )
    if case.covering and stats["sparse_steps"]:
        failures.append(f"{stats['sparse_steps']} sparse steps with a budget covering the context")
    return failures


def check_case(case: Case) -> dict[str, list[str]]:
    """Run ``case``; ``{invariant: [what failed]}`` for the invariants that failed (empty if all hold).
    An exception inside ``generate()`` is reported as the invariant ``"crash"``."""
    failures: dict[str, list[str]] = {}
    try:
        _check(case, failures)
    except Exception as error:  # noqa: BLE001 -- a crash deep inside is a finding, reported with its case
        failures.setdefault("crash", []).append(f"{type(error).__name__}: {str(error)[:400]} ({_where(error)})")
    return {k: v for k, v in failures.items() if v}


def _where(error: Exception) -> str:
    """The innermost dustin_hf frame of ``error``'s traceback, and the innermost frame, as ``file:line``."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "dustin_hf" in f.filename or "/patches/" in f.filename]
    spots = [ours[-1]] if ours else []
    if frames and frames[-1] not in spots:
        spots.append(frames[-1])
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(spots))


def _check(case: Case, failures: dict[str, list[str]]) -> None:
    target, draft = build_pair(case)
    rows = prompts(case)
    kwargs = _generate_kwargs(case)
    greedy_alone = None
    if case.covering and not case.do_sample and case.padding == "right":
        # right padding is read as stock reads it (a row's positions restart after its padding), so the reference
        # is stock greedy on the same padded batch, not the row alone; processors see each row's left-unpadded
        # input in both (a right-padded row has no left padding)
        ids, mask = pad_batch(rows, case.padding)
        out = target.generate(ids, attention_mask=mask, **kwargs)
        greedy_alone = [_row_tokens(out, ids.shape[1], b, case.eos) for b in range(len(rows))]
    elif case.covering and not case.do_sample:
        greedy_alone = []
        for row in rows:  # stock greedy, each prompt alone and unpadded, before anything is patched
            out = target.generate(row[None], **kwargs)
            greedy_alone.append(_row_tokens(out, row.numel(), 0, case.eos))
    with dustin_hf.patch(target), _observe_reads(target, case) as reads:
        ids, sequences, stats = _dustin(target, draft, case, rows)
        failures["well_formed"] = _well_formed(case, ids, sequences)
        try:
            _independence(target, draft, case, rows, ids, sequences, greedy_alone, failures)
        finally:  # every run's reads (the batch-mates' runs too), checked even when one of them crashed
            chosen = resolve(DustinConfig(**case.cache_config()), target.config, draft.config).selection_layers
            failures["reads"] = _read_bound(case, stats, reads, chosen)


def _independence(target, draft, case: Case, rows, ids, sequences, greedy_alone, failures) -> None:
    """The ``alone`` invariant (covering budget, greedy), else the ``mates`` one."""
    mine = [_row_tokens(sequences, ids.shape[1], b, case.eos) for b in range(len(rows))]
    if greedy_alone is not None:
        failures["alone"] = [
            f"row {b}: {_first_difference(got, want)}"
            for b, (got, want) in enumerate(zip(mine, greedy_alone))
            if got != want
        ]
        return
    b = case.subject
    mates_failures = []
    if len(rows) > 1 and case.calibration != "prompt":
        mates = prompts(case, salt=1)
        mates[b] = rows[b]
        ids2, sequences2, _ = _dustin(target, draft, case, mates)
        got = _row_tokens(sequences2, ids2.shape[1], b, case.eos)
        if got != mine[b]:
            mates_failures.append(f"row {b} with other batch-mates: {_first_difference(got, mine[b])}")
    if not case.do_sample and len(rows) > 1 and case.padding == "left" and case.calibration != "prompt":
        # (right padding depends on the batch width)
        alone_case = dataclasses.replace(case, lengths=(case.lengths[b],), subject=0, padding="left")
        ids3, sequences3, _ = _dustin(target, draft, alone_case, [rows[b]])
        got = _row_tokens(sequences3, ids3.shape[1], 0, case.eos)
        if got != mine[b]:
            mates_failures.append(f"row {b} decoded alone (same settings): {_first_difference(got, mine[b])}")
    failures["mates"] = mates_failures


def report(case: Case, failures: dict[str, list[str]], reproduce: str | None = None) -> str:
    """The failure message: what failed, every drawn parameter, and one line that runs the case again
    (``reproduce``, by default the drawn case's own, which a shrunk or pinned case does not have)."""
    lines = [f"fuzz case {case.name} failed: {', '.join(failures)}"]
    for invariant, what in failures.items():
        lines += [f"  [{invariant}] {w}" for w in what]
    lines += [f"  case: {case.to_json()}", f"  reproduce: {reproduce or reproduction(case)}"]
    if reproduce is None:
        lines.append(f"  shrink: python tests/fuzz.py --seed {case.seed} --case {case.index} --shrink")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ shrinking
def _simpler(case: Case):
    """Candidate cases one simplification away from ``case``, roughly most useful first."""
    n = len(case.lengths)
    for drop in range(n):
        if drop != case.subject and n > 1:
            lengths = case.lengths[:drop] + case.lengths[drop + 1 :]
            yield dataclasses.replace(case, lengths=lengths, subject=case.subject - (drop < case.subject))
    for i, _ in enumerate(case.processors):
        yield dataclasses.replace(case, processors=case.processors[:i] + case.processors[i + 1 :])
    simple = dict(
        threshold=0.0,
        eos=(),
        sparse_draft=False,
        dense_layers=(),
        calibration="none",
        selection="dustin",
        sampling=(),
        do_sample=False,
        padding="left",
        draft_share=None,
        max_new_tokens=max(4, case.max_new_tokens // 2),
        gamma=max(1, case.gamma - 1),
        layers=max(1, case.layers - 1),
        draft_layers=max(1, case.draft_layers - 1),
    )
    for name, value in simple.items():
        if getattr(case, name) != value:
            yield dataclasses.replace(case, **{name: value})
    for i, length in enumerate(case.lengths):
        for shorter in sorted({max(1, length // 2), max(1, (3 * length) // 4), max(1, length - 1)}):
            if shorter < length:
                yield dataclasses.replace(case, lengths=case.lengths[:i] + (shorter,) + case.lengths[i + 1 :])


def _size(case: Case) -> tuple:
    return (
        len(case.lengths),
        len(case.processors),
        sum(case.lengths),
        case.max_new_tokens,
        case.gamma,
        case.layers + case.draft_layers,
    )


def _kind(failures: dict[str, list[str]], invariant: str) -> str | None:
    """What identifies a failure of ``invariant`` across cases: its name, and for a crash the exception's type
    and where it was raised."""
    if invariant not in failures:
        return None
    if invariant != "crash":
        return invariant
    first = failures["crash"][0]
    return first.split(":")[0] + first[first.rfind("(") :]


def shrink(case: Case, invariant: str, log=print) -> Case:
    """A smaller case (by :func:`_simpler` steps) that still fails ``invariant`` the same way."""
    kind = _kind(check_case(case), invariant)
    improved = True
    while improved:
        improved = False
        for candidate in _simpler(case):
            if _kind(check_case(candidate), invariant) == kind:
                log(f"  smaller: {candidate.to_json()}")
                case, improved = candidate, True
                break
    return case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--case", type=int)
    parser.add_argument("--json", help="a case as printed by a failure")
    parser.add_argument("--shrink", action="store_true", help="search for a smaller case failing the same way")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    case = from_json(args.json) if args.json else draw_case(args.seed, args.case)
    failures = check_case(case)
    if not failures:
        print(f"{case.name}: every invariant holds\n  case: {case.to_json()}")
        return 0
    print(report(case, failures))
    if args.shrink:
        invariant = next(iter(failures))
        small = shrink(case, invariant)
        again = f"python tests/fuzz.py --json '{small.to_json()}'"
        print(f"smallest found, failing {invariant!r}:\n{report(small, check_case(small), reproduce=again)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
