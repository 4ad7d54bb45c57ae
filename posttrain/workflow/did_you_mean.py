"""The hint every refusal of an unknown name ends with: a leaf, so the schema and the dry run's checks share it."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def suggest(word: str, choices: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for a close match, else ``."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""
