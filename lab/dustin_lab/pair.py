"""Load a target/draft pair from two local folders, with checks that fail early and say why.

Used by the command line and by calibration/evaluation. Checks run before any weights are read:
each folder must be a transformers model folder (``config.json``), and the two tokenizers must be
the same (Dustin lines up positions one to one, so the draft must tokenize exactly like the target).
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "ModelPair",
    "ModelPathError",
    "add_device_options",
    "TokenizerMismatchError",
    "check_model_dir",
    "describe_machine",
    "load_pair",
    "resolve_device",
    "resolve_dtype",
]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelPathError(FileNotFoundError):
    """A model folder is missing or is not a transformers model folder."""


class TokenizerMismatchError(ValueError):
    """The draft does not tokenize like the target."""


@dataclass
class ModelPair:
    """A loaded target and draft (eval mode) with their shared tokenizer."""

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    target_dir: Path
    draft_dir: Path
    device: torch.device
    dtype: torch.dtype

    def describe(self) -> dict:
        """JSON-able names and shapes of both models, for reports and profiles."""
        return {
            "target": _describe(self.target, self.target_dir),
            "draft": _describe(self.draft, self.draft_dir),
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }


def _describe(model, folder: Path) -> dict:
    cfg = model.config.get_text_config()
    return {
        "name": folder.name,
        "path": str(folder),
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", cfg.num_attention_heads),
        "vocab_size": cfg.vocab_size,
    }


def resolve_device(name: str = "auto") -> torch.device:
    """``"auto"``: CUDA when available, else CPU; otherwise the named device (checked)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is available here; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"``: bfloat16 on CUDA, float32 on CPU (CPUs without bf16 units run bf16 several times slower)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def add_device_options(parser) -> None:
    """``--device`` and ``--dtype`` for a script that loads the pair (:func:`load_pair`'s ``device`` and ``dtype``):
    by default CUDA in bfloat16 where there is a GPU, else the CPU in float32."""
    parser.add_argument("--device", default="auto", help="auto (CUDA when available, else cpu), cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        help=f"auto (bfloat16 on CUDA, float32 on the CPU) or one of {', '.join(sorted(_DTYPES))}",
    )


def check_model_dir(path: str | Path, role: str) -> Path:
    """``path`` as a folder holding ``config.json``, or a :class:`ModelPathError` naming ``role``."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelPathError(
            f"{role} model path {str(folder)!r} does not exist; pass a folder saved with "
            "save_pretrained(), or omit --target/--draft to use the offline Qwen2.5-Coder pair"
        )
    if not (folder / "config.json").is_file():
        raise ModelPathError(
            f"{role} model path {str(folder)!r} has no config.json: it is not a transformers model folder"
        )
    return folder


def load_tokenizers(target_dir: Path, draft_dir: Path):
    """The target's tokenizer, after checking that the draft's has the same vocabulary."""
    from transformers import AutoConfig, AutoTokenizer

    t_tok, d_tok = AutoTokenizer.from_pretrained(target_dir), AutoTokenizer.from_pretrained(draft_dir)
    t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
    if t_vocab != d_vocab:
        only_t, only_d = len(t_vocab.keys() - d_vocab.keys()), len(d_vocab.keys() - t_vocab.keys())
        raise TokenizerMismatchError(
            f"the target ({target_dir.name}, {len(t_vocab):,} tokens) and draft ({draft_dir.name}, {len(d_vocab):,} "
            f"tokens) tokenizers differ ({only_t} tokens only in the target's, {only_d} only in the draft's, the rest "
            "may map to different ids); Dustin needs a draft that shares the target's tokenizer"
        )
    t_cfg = AutoConfig.from_pretrained(target_dir).get_text_config()
    d_cfg = AutoConfig.from_pretrained(draft_dir).get_text_config()
    if d_cfg.vocab_size > t_cfg.vocab_size or len(t_vocab) > t_cfg.vocab_size:
        raise TokenizerMismatchError(
            f"vocabulary sizes do not fit: tokenizer {len(t_vocab):,}, target embedding {t_cfg.vocab_size:,}, draft "
            f"embedding {d_cfg.vocab_size:,}; the draft must share the target's tokenizer"
        )
    return t_tok


def load_pair(
    target_dir: str | Path, draft_dir: str | Path, device: str = "auto", dtype: str = "auto", check=None
) -> ModelPair:
    """Check both folders and the tokenizers, then load both models on ``device`` in ``dtype``.

    ``check(tokenizer)``, if given, runs before any weights are read (e.g. to check that the texts
    are long enough), so that bad arguments fail in seconds.
    """
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir = check_model_dir(target_dir, "target"), check_model_dir(draft_dir, "draft")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    tokenizer = load_tokenizers(target_dir, draft_dir)
    if check is not None:
        check(tokenizer)
    models = [
        AutoModelForCausalLM.from_pretrained(d, dtype=torch_dtype).to(torch_device).eval()
        for d in (target_dir, draft_dir)
    ]
    return ModelPair(models[0], models[1], tokenizer, target_dir, draft_dir, torch_device, torch_dtype)


def describe_machine(device: torch.device) -> dict:
    """Where a measurement ran: CPU model and threads or GPU name, and library versions."""
    import transformers

    from dustin_hf import __version__

    info = {
        "device": str(device),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dustin_hf": __version__,
        "git_commit": _git_commit(),
        "cpu": _cpu_name(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _git_commit() -> str | None:
    """The checkout's commit (with ``+dirty`` for uncommitted changes), or ``None`` outside a git checkout."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
