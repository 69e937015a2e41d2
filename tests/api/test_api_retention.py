"""Retention policy as a pure function (no filesystem)."""

from __future__ import annotations

import pytest

from smpckpt.catalog._abandoned import KeepLatestN, decided_by_copy, select_for_removal, split_lineage
from smpckpt.catalog.root import CheckpointRecord, record_order, validate_keep
from smpckpt.storage.format.manifest import Manifest, MetadataRecord


def rec(tag: str, t: int, committed: bool = True) -> CheckpointRecord:
    return CheckpointRecord(tag, committed, (t, 0, ""))


def test_keeps_n_newest_by_time_not_name() -> None:
    records = [rec("step10", 3), rec("step9", 2), rec("step100", 1), rec("step2", 4)]
    assert select_for_removal(records, 2) == ["step100", "step9"]  # oldest first
    assert KeepLatestN(2).should_preserve(records) == [True, False, False, True]


def test_never_removes_protected_or_uncommitted() -> None:
    records = [rec("a", 1), rec("b", 2), rec("c", 3), rec("crashed", 0, committed=False), rec("d", 4, committed=False)]
    assert select_for_removal(records, 1, protected={"a"}) == ["b"]
    assert select_for_removal(records, 1) == ["a", "b"]


def test_keep_more_than_exist() -> None:
    assert select_for_removal([rec("a", 1)], 5) == []
    assert select_for_removal([], 1) == []


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "1"])
def test_bad_keep(bad: object) -> None:
    with pytest.raises(ValueError):
        validate_keep(bad)
    with pytest.raises(ValueError):
        KeepLatestN(bad)  # type: ignore[arg-type]


def test_validate_keep_none_and_positive() -> None:
    assert validate_keep(None) is None and validate_keep(1) == 1


def test_record_order_prefers_sequence_then_ns_then_created() -> None:
    assert record_order({"extra": {"saved_at_ns": 5}, "save_id": "x"}) == (0, 5, "x")
    assert record_order({"extra": {"sequence": 2, "saved_at_ns": 1}, "save_id": "x"}) == (2, 1, "x")
    a = record_order({"created": "2026-01-01T00:00:00+00:00", "save_id": "a"})
    b = record_order({"created": "2026-01-02T00:00:00+00:00", "save_id": "b"})
    assert a < b
    assert record_order(None) == (0, 0, "")


def _saved(tag: str, seq: int, abandoned: list[list[int]] | None = None) -> CheckpointRecord:
    extra: dict[str, object] = {"sequence": seq, **({"abandoned": abandoned} if abandoned is not None else {})}
    manifest = Manifest("id-" + tag, "partial", "raw", MetadataRecord(".metadata", 0, 0), (), 1, "", extra)
    return CheckpointRecord(tag, True, record_order(manifest), manifest=manifest)


def test_retention_after_a_rollback_keeps_the_history_and_never_removes_nor_counts_the_abandoned() -> None:
    # s1..s5, then a roll-back to s3 (s4, s5 abandoned), then s6 and s7 carrying the record on
    records = [_saved(f"s{i}", i) for i in range(1, 6)] + [_saved("s6", 6, [[4, 5]]), _saved("s7", 7, [[4, 5]])]
    history, dropped = split_lineage(records)
    assert [r.tag for r in history] == ["s7", "s6", "s3", "s2", "s1"]
    assert [r.tag for r in dropped] == ["s5", "s4"]
    assert select_for_removal(records, 3) == ["s1", "s2"]  # s4, s5: an inference, never acted on
    assert select_for_removal(records, 1, protected={"s2"}) == ["s1", "s3", "s6"]  # `newest` still protected
    # the root's copy of a damaged s8's record (s6, s7 abandoned by it) counts as the history's newest
    assert select_for_removal(records, 2, abandoned=[(6, 7), (4, 5)]) == ["s1"]


def test_lineage_of_saves_without_the_record_is_todays_order() -> None:
    records = [_saved("old", 0), _saved("s1", 1), _saved("s2", 2), rec("legacy", 0)]
    assert [r.tag for r in split_lineage(records)[0]] == ["s2", "s1", "old", "legacy"]
    assert select_for_removal(records, 2) == ["legacy", "old"]
    # a second roll-back further back, and a damaged record (ignored: today's order from there)
    later = [_saved("s3", 3, [[2, 2]]), _saved("s4", 4, [[1, 3], [2, 2]]), _saved("bad", 5, [["x", 1]])]
    assert [r.tag for r in split_lineage(records + later)[0]] == ["bad", "s4", "old", "legacy"]


def test_a_record_abandoning_numbers_not_below_its_own_is_ignored() -> None:
    records = [_saved("s1", 1), _saved("s2", 2), _saved("crafted", 3, [[1, 7]])]
    assert [r.tag for r in split_lineage(records)[0]] == ["crafted", "s2", "s1"]


class _CountedRange(tuple):  # type: ignore[type-arg]
    """A range whose unpacking counts itself: the work split_lineage spends on ranges."""

    unpacked = [0]

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountedRange.unpacked[0] += 1
        return super().__iter__()


def test_split_lineage_spends_linear_work_on_carried_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    """rev60c F4: every save carries its history's 16 ranges on: each was appended again per save, and every
    older save checked against them all (4,000 saves: 15 s). Counted, not timed: a carried range counts once."""
    from smpckpt.catalog import _abandoned

    real = _abandoned.abandoned_of
    monkeypatch.setattr(_abandoned, "abandoned_of", lambda extra: tuple(_CountedRange(p) for p in real(extra)))
    carried = [[k * 10 + 1, k * 10 + 5] for k in reversed(range(16))]
    n = 1000
    records = [_saved(f"s{i}", i, carried if i > 160 else None) for i in range(1, n + 1)]
    history, dropped = split_lineage(records)
    assert len(dropped) == 80 and [r.tag for r in dropped[:2]] == ["s155", "s154"]
    assert len(history) == n - 80
    assert _CountedRange.unpacked[0] < 64 * n  # quadratic: ~16 * n * n / 2


def test_the_root_copy_is_named_only_when_its_ranges_decided() -> None:
    """rev60d F3: the fallback and ``ls`` named ``smpckpt.abandoned`` whenever it was read and anything was
    dropped, also when the saves' own records dropped the same (a stale copy of a later roll-back)."""
    records = [_saved(f"s{i}", i) for i in range(1, 6)] + [_saved("s6", 6, [[4, 5]])]
    assert not decided_by_copy(records, [(7, 8)])  # s6's own record dropped s4, s5; the copy adds nothing
    assert not decided_by_copy(records, [(4, 5)])
    assert decided_by_copy(records, [(6, 6)])  # the copy drops s6, which no save's record does
    assert not decided_by_copy(records, ())
