"""Calibration profiles: the JSON file ``dustin-hf calibrate`` writes and :func:`dustin_hf.patch` loads.

The format belongs to the library (:meth:`DustinConfig.from_profile` reads its ``"config"`` section); the
lab's calibration writes it through :func:`write_profile`.

    {
      "format": "dustin_hf.profile/1",
      "config": {...DustinConfig fields...},    # what DustinConfig.from_profile / dustin_hf.patch load
      "draft_share_fraction": 0.25,             # m as a share of budget - sink - recent, for other budgets
      "recovery": {...}, "default_recovery": {...}, "model_pair": {...}, "texts": [...], "seconds": 812.4, ...
    }

``config.draft_share`` is an absolute count tied to ``config.budget``; evaluating the profile at
another budget rescales it with :func:`config_for_budget` (``DustinConfig`` rejects a ``draft_share``
larger than ``budget - sink_tokens - recent_tokens``).
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import DustinConfig

__all__ = ["PROFILE_FORMAT", "config_for_budget", "read_profile", "write_profile"]

PROFILE_FORMAT = "dustin_hf.profile/1"


def read_profile(path: str | Path) -> tuple[DustinConfig, float | None, dict]:
    """``(config, draft_share_fraction or None, the whole JSON)``; clear errors for a missing or bad file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"profile {str(path)!r} does not exist; write one with `dustin-hf calibrate --out {path}`"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not valid JSON: {e}") from None
    config = DustinConfig.from_profile(path)
    fraction = data.get("draft_share_fraction") if isinstance(data, dict) else None
    return config, fraction, data


def config_for_budget(config: DustinConfig, fraction: float | None, budget: int) -> DustinConfig:
    """``config`` at ``budget``: ``draft_share`` rescaled by ``fraction`` (or kept if it still fits, else halved
    to the default)."""
    free = budget - config.sink_tokens - config.recent_tokens
    if fraction is not None:
        share = int(round(fraction * free))
    elif config.draft_share is not None and config.draft_share <= free:
        share = config.draft_share
    else:
        share = None
    return config.replace(budget=budget, draft_share=share)


def write_profile(path: str | Path, config: DustinConfig, fraction: float | None, **sections) -> Path:
    """Write a profile JSON (``sections`` are added as top-level keys); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": PROFILE_FORMAT, "config": config.to_dict(), "draft_share_fraction": fraction, **sections}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
