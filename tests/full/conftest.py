"""Full-mode tests watch in-progress markers for a second, not the production 16 s (``_full_marker``):
the rule -- a marker that changes belongs to a running save -- is the same at any pace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def fast_marker_watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from smpckpt.storage.full import _marker as _full_marker

    monkeypatch.setattr(_full_marker, "REFRESH_S", 0.2)
    monkeypatch.setattr(_full_marker, "WATCH_S", 1.0)
    yield
