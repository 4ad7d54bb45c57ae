"""The resolved config a stage script is run with (see docs/architecture.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESOLVED_KEYS = ("stage", "key", "upstream", "seed")


def load_resolved_config(path: str | Path) -> dict[str, Any]:
    """Read RESOLVED.json: the variant's whole config plus `stage`, `key` and `upstream`."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"resolved config {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"resolved config {path}: not valid JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"resolved config {path}: must be a JSON object, got {type(cfg).__name__}")
    missing = [k for k in RESOLVED_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"resolved config {path}: missing key(s) {', '.join(missing)}")
    return cfg
