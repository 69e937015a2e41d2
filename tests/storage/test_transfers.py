"""Files moved between ranks by :func:`smpckpt.storage.tier.reader.run_transfers` (a resume's fetches from
peers, a healed copy's), on 3 real gloo ranks over 3 streams, with a chunk size far below the files'
(tests/storage/transfer_workers.py): every chunk boundary, byte-exact; a sender's refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import transfer_workers as tw
from dist_harness import run_world


@pytest.mark.dist
def test_transfers_in_small_chunks_are_byte_exact(tmp_path: Path) -> None:
    out = run_world(tw.small_chunks, 3, str(tmp_path), timeout=120)
    for rank, got in enumerate(out):
        want = sorted(tw.name(src, size) for src in range(3) if src != rank for size in tw.SIZES)
        assert got["received"] == want, (rank, got["received"])
        assert got["exact"] == {n: True for n in want}, (rank, got["exact"])
        assert not [n for n in got["listing"] if ".recv." in n or n in ("absent.bin",)], got["listing"]
    # rank 0 could not send either (nothing reached rank 1 under those names), and said why
    assert len(out[0]["errors"]) == 2 and "absent.bin" in out[0]["errors"][0], out[0]["errors"]
    assert "5 bytes, the manifest says 6" in out[0]["errors"][1], out[0]["errors"]
    # each names its file's path once (an OSError's text ends with it again: fix63c)
    assert [e.count("node0/absent.bin") for e in out[0]["errors"][:1]] == [1], out[0]["errors"]
    assert out[0]["errors"][1].count("node0/short.bin") == 1, out[0]["errors"]
    assert "short.bin" not in out[1]["listing"] and not out[2]["errors"]
    assert sorted(out[1]["errors"]) == ["absent.bin: rank 0 could not send it", "short.bin: rank 0 could not send it"]
