"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest

from posttrain.losses import chunked


@pytest.fixture
def chunk_small_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lift the whole-logits shortcut for small logits, so tests on toy shapes run the chunked path."""
    monkeypatch.setattr(chunked, "SMALL_LOGITS", 0)
