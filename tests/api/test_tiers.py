"""Tiered checkpoints (``local_path=``) in one process, one node (``replicas=1``): saves, resumes, tags
asked for, histories of the fast tier, the options refused by name. The drain: test_tiers_drain.py; 2 simulated
nodes x 2 gloo ranks: test_tiers_ranks.py."""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from tier_helpers import job as _job
from tier_helpers import linear as _linear
from tier_helpers import partials as _partials
from tier_helpers import same as _same
from tier_helpers import tier_record as _tier_record
from torch import nn

from smpckpt import (
    CheckpointCorrupt,
    Checkpointer,
    CheckpointError,
    CheckpointExists,
    DrainStatus,
    FastTier,
    LayoutMismatch,
    ResumeOptions,
    drain_status,
    last_resume_info,
    resume_from_checkpoint,
    save_checkpoint,
    wait_for_saves,
)
from smpckpt.api._tiers import durable_key, job_folder
from smpckpt.errors import LOADED_IN_PLACE
from smpckpt.storage import read_manifest


# -- one process, one node ---------------------------------------------------------------------------
def test_one_node_saves_drains_every_second_and_resumes_newest(tmp_path: Path) -> None:
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    local = _job(fast, durable)
    models = {}
    for step in range(1, 4):
        models[step] = _linear(step)
        save_checkpoint(durable, f"s{step}", model=models[step], local_path=fast, replicas=1, durable_every=2)
    wait_for_saves()
    assert drain_status() == DrainStatus("s2", "done")
    assert _partials(local) == ["s2_partial", "s3_partial"]  # num_kept_local=2
    assert sorted(os.listdir(durable)) == ["newest", "s2_partial"]
    assert (durable / "newest").read_text().strip() == "s2"
    assert [_tier_record(local / f"s{s}_partial")["seq"] for s in (2, 3)] == [2, 3]
    s2_record = _tier_record(durable / "s2_partial")
    # each save names the saves it was numbered after by their manifests' digests (s1's: gone by now)
    s1_digest = s2_record.pop("lineage")
    assert len(s1_digest) == 1 and len(s1_digest[0]) == 16
    # and its history's segments: [random id, first number] (each model here is a new Checkpointer: one each)
    runs = s2_record.pop("runs")
    assert [n for _, n in runs] == [1, 2] and all(len(i) == 16 for i, _ in runs), runs
    assert _tier_record(local / "s3_partial")["runs"][:2] == runs
    s2_manifest = (local / "s2_partial" / "smpckpt.manifest.json").read_bytes()
    assert _tier_record(local / "s3_partial")["lineage"] == [
        f"{xxhash.xxh3_64_intdigest(s2_manifest):016x}",
        *s1_digest,
    ]
    assert s2_record == {
        "seq": 2,
        "durable": True,
        "replicas": 1,
        "nodes": 1,
        "local_world_size": 1,
        "root": durable_key(str(durable), None),  # the durable root this copy belongs to
        "path_seen": 0,  # path held nothing when s2 was planned (s1 was not due for it)
        "due": [],  # no save of its job due for path above that (fix70f)
    }
    # the durable copy is the fast tier's, byte for byte (drained from its files)
    for name in os.listdir(local / "s2_partial"):
        assert (durable / "s2_partial" / name).read_bytes() == (local / "s2_partial" / name).read_bytes()

    got = _linear(99)
    resume_from_checkpoint(durable, model=got, local_path=fast)
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier, info.from_peers) == ("s3", "fast", ())
    assert _same(got, models[3])

    # a restart (nothing cached) keeps counting from the saves already there: s4 is save 4, durable
    models[4] = _linear(4)
    save_checkpoint(durable, "s4", model=models[4], local_path=fast, replicas=1, durable_every=2)
    wait_for_saves()
    assert _tier_record(durable / "s4_partial")["seq"] == 4

    for name in _partials(local):  # the whole fast tier lost: the newest durable checkpoint
        (local / name).rename(tmp_path / f"gone-{name}")
    got = _linear(98)
    resume_from_checkpoint(durable, model=got, local_path=fast)
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s4", "durable")
    assert _same(got, models[4])


def test_corrupt_fast_copy_falls_back_to_the_next_one_then_the_durable_one(tmp_path: Path) -> None:
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    local = _job(fast, durable)
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "s1", model=m1, local_path=fast, replicas=1)
    save_checkpoint(durable, "s2", model=m2, local_path=fast, replicas=1, durable_every=1)
    wait_for_saves()
    data = [p for p in (local / "s2_partial").iterdir() if p.name.endswith(".distcp")]
    raw = bytearray(data[0].read_bytes())
    raw[-1] ^= 0xFF
    data[0].write_bytes(bytes(raw))
    (durable / "s2_partial" / "smpckpt.manifest.json").unlink()  # the durable s2 is gone too: s1 there
    for tier in ("fast", "durable"):  # the fast tier's s1 next; without it, path's s1
        got = _linear(99)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resume_from_checkpoint(durable, model=got, local_path=fast)
        said = [str(w.message) for w in caught]
        assert any("'s2' has corrupt parts" in m and "no node holds an intact copy" in m for m in said), said
        # the caller's line (rev62h F4: the corrupt-parts warning named the package's)
        assert {w.filename for w in caught if "corrupt parts" in str(w.message)} == {__file__}, said
        assert any("'s2' from the fast tier failed" in m for m in said), said  # the fast copy, then ...
        assert any("newest names 's2', which is not a committed" in m for m in said), said  # ... path's newest
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == ("s1", tier)
        assert _same(got, m1)
        if tier == "fast":
            shutil.rmtree(local / "s1_partial")


@pytest.mark.parametrize("strict", [True, False])
def test_a_fallback_after_a_failed_read_still_says_the_model_holds_its_values(tmp_path: Path, strict: bool) -> None:
    """rev66c F1, F3: s2's fast copy fails mid-read (a damaged file: what it read is in the model), and the
    fallback s1 (saved without biases) is refused by strict before its own read: the error said nothing of s2's
    values in the model. Under strict=False s1 loads and skips the biases, which keep s2's values: the fallback's
    warning dropped the note that says so."""
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    local = _job(fast, durable)
    for tag, bias in (("s1", False), ("s2", True)):
        torch.manual_seed(len(tag) + bias)
        m = nn.Sequential(nn.Linear(64, 64, bias=bias), nn.Linear(64, 64, bias=bias))
        save_checkpoint(durable, tag, model=m, local_path=fast, replicas=1, durable_every=1)
    wait_for_saves()
    damaged = sorted(p for p in (local / "s2_partial").iterdir() if p.name.endswith(".distcp"))[0]
    raw = bytearray(damaged.read_bytes())
    raw[-10] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    (durable / "s2_partial" / "smpckpt.manifest.json").unlink()  # path's fallback is s1 too
    got = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    if strict:
        with pytest.raises(LayoutMismatch) as refused:
            resume_from_checkpoint(durable, model=got, local_path=fast)
        assert str(refused.value).endswith(LOADED_IN_PLACE), refused.value
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume_from_checkpoint(durable, model=got, local_path=fast, options=ResumeOptions(strict=False))
    fell_back = [str(w.message) for w in caught if "from the fast tier failed" in str(w.message)]
    assert len(fell_back) == 1 and LOADED_IN_PLACE in fell_back[0], [str(w.message) for w in caught]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 3}, "replicas apply only with local_path"),
        ({"durable_every": 3, "num_kept_local": 1}, "durable_every, num_kept_local apply only with local_path"),
        ({"local_path": "s3://bucket/x"}, "not a URL"),
        ({"local_path": "LOCAL", "replicas": 2}, "replicas=2 needs 2 nodes, this job has 1"),
        ({"local_path": "LOCAL", "replicas": 0}, "replicas must be >= 1"),
        ({"local_path": "LOCAL", "durable_every": 0}, "durable_every must be >= 1"),
        ({"local_path": "LOCAL", "overwrite": True}, "overwrite does not apply with local_path"),
        ({"local_path": "LOCAL", "partial": False}, "local_path applies only to partial checkpoints"),
    ],
)
def test_tier_options_refused_by_name(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    kwargs = {k: str(tmp_path / "fast") if v == "LOCAL" else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=message):
        save_checkpoint(tmp_path / "durable", "t", model=_linear(0), **kwargs)
    assert not (tmp_path / "durable").exists() and not (tmp_path / "fast").exists()


@pytest.mark.parametrize("scheme", ["", "file://", "local://"])
def test_local_path_as_a_local_url_is_the_folder(tmp_path: Path, scheme: str) -> None:
    """rev72j L1: ``local://`` names local disk as ``file://`` does (Location takes both); it was refused as a URL."""
    assert FastTier(local_path=f"{scheme}{tmp_path}/fast").local_path == f"{tmp_path}/fast"
    if scheme:  # the scheme alone names no folder: not the working directory (rev72o)
        with pytest.raises(ValueError, match=f"local_path '{scheme}' names no folder"):
            FastTier(local_path=scheme)


def test_local_path_apart_from_path_and_a_folder_refused_by_name(tmp_path: Path) -> None:
    """(one process) ``local_path`` equal to ``path``, inside it or containing it; a file; a folder
    that cannot be written: refused before anything is written, naming the argument."""
    durable = tmp_path / "durable"
    durable.mkdir()
    (tmp_path / "file").write_bytes(b"x")
    for local, message in (
        (durable, "is the same folder as path"),
        (durable / "fast", "is inside path"),
        (tmp_path, "contains path"),
        (tmp_path / "file", "local_path '.*file' is not a folder"),
    ):
        with pytest.raises(ValueError, match=message):
            save_checkpoint(durable, "t", model=_linear(0), local_path=local, replicas=1)
        with pytest.raises(ValueError, match=message):
            resume_from_checkpoint(durable, model=_linear(0), local_path=local)
    assert sorted(os.listdir(durable)) == [] and sorted(os.listdir(tmp_path)) == ["durable", "file"]
    if os.access("/sys", os.W_OK) and not os.path.isdir("/sys/kernel"):
        pytest.skip("no folder that cannot be written here")
    with pytest.raises(ValueError, match="local_path '/sys' is not writable"):
        save_checkpoint(durable, "t", model=_linear(0), local_path="/sys", replicas=1)


def test_a_tag_in_either_tier_is_not_saved_again(tmp_path: Path) -> None:
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=fast, replicas=1)
    wait_for_saves()
    with pytest.raises(Exception, match="already committed in the fast tier"):
        save_checkpoint(durable, "s1", model=_linear(2), local_path=fast, replicas=1)
    os.rename(_job(fast, durable) / "s1_partial", tmp_path / "moved")
    with pytest.raises(Exception, match="already holds a committed checkpoint"):
        save_checkpoint(durable, "s1", model=_linear(2), local_path=fast, replicas=1)


def test_a_folder_the_job_does_not_own_is_neither_loaded_nor_saved_over(tmp_path: Path) -> None:
    """A copy of s1 placed in the job's folder as s2 (its manifest names tag s1): foreign. A resume
    skips it with a warning; a save of s2 is refused, leaving it as it was."""
    durable, fast = tmp_path / "durable", tmp_path / "fast"
    job = _job(fast, durable)
    m1 = _linear(1)
    save_checkpoint(durable, "s1", model=m1, local_path=fast, replicas=1, durable_every=5)
    shutil.copytree(job / "s1_partial", job / "s2_partial")
    got = _linear(9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume_from_checkpoint(durable, model=got, local_path=fast)
    assert any("folder s2_partial is foreign (checkpoint 's1' of" in str(w.message) for w in caught)
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s1", "fast") and _same(got, m1)
    before = sorted(os.listdir(job / "s2_partial"))
    with pytest.raises(CheckpointExists, match="s2_partial is foreign"):
        save_checkpoint(durable, "s2", model=_linear(2), local_path=fast, replicas=1, durable_every=5)
    assert sorted(os.listdir(job / "s2_partial")) == before


def test_drain_to_s3_and_resume_from_it(s3_root: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """S3 (moto on loopback) as the durable root: the fast tier writes the files under hex prefixes,
    the drain copies them under the same names, and a resume without the fast tier reads them."""
    import s3fs

    root, options = s3_root
    local = tmp_path / "fast"
    m1 = _linear(1)
    save_checkpoint(root, "s1", model=m1, local_path=local, replicas=1, storage_options=options)
    wait_for_saves()
    fs = s3fs.S3FileSystem(**options)
    bucket_path = root[len("s3://") :]
    names = sorted(p[len(bucket_path) + 1 :] for p in fs.find(f"{bucket_path}/s1_partial"))
    job = Path(job_folder(str(local), durable_key(root, options)))
    local_names = sorted(str(p.relative_to(job / "s1_partial")) for p in (job / "s1_partial").rglob("*") if p.is_file())
    assert [n.split("/", 1)[1] for n in names] == local_names
    assert any(n.count("/") == 2 for n in names)  # s1_partial/<prefix>/<file>
    got = _linear(9)
    resume_from_checkpoint(root, model=got, storage_options=options, local_path=tmp_path / "empty")
    info = last_resume_info()
    assert info is not None and (info.tag, info.tier) == ("s1", "durable")
    assert _same(got, m1)


def test_tag_asked_for_comes_from_the_fast_tier_when_its_drain_never_committed(tmp_path: Path) -> None:
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "s1", model=m1, local_path=local, replicas=1)
    save_checkpoint(durable, "s2", model=m2, local_path=local, replicas=1)
    wait_for_saves()
    (durable / "s2_partial" / "smpckpt.manifest.json").unlink()  # as a drain killed before its commit
    for tag, want in (("s1", m1), ("s2", m2)):
        got = _linear(9)
        resume_from_checkpoint(durable, tag=tag, model=got, local_path=local)
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == (tag, "fast")
        assert _same(got, want)
    with pytest.raises(Exception, match="no checkpoint 's3'"):
        resume_from_checkpoint(durable, tag="s3", model=_linear(9), local_path=local)


def test_tag_asked_for_incomplete_in_the_fast_tier_is_refused_saying_so(tmp_path: Path) -> None:
    """The refusal named only path ("no checkpoint 's1' under ..."), as if the tag had never been saved,
    while the fast tier holds it committed but missing a part (a lost node's): now it says so, by file."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=local, replicas=1, durable_every=5)
    folder = _job(local, durable) / "s1_partial"
    lost = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    (folder / lost).unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointError, match=f"no checkpoint 's1' under .*committed but incomplete .*{lost}"):
            resume_from_checkpoint(durable, tag="s1", model=_linear(9), local_path=local)


def test_nothing_to_resume_in_either_tier_names_both(tmp_path: Path) -> None:
    """hunt67 note: a fast tier lost before its first drain gave "no committed checkpoint under <path>",
    not naming the fast tier searched; one holding only an incomplete copy said nothing of it either."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=local, replicas=1, durable_every=5)
    folder = _job(local, durable) / "s1_partial"
    lost = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]
    (folder / lost).unlink()  # a lost node's part
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(
            CheckpointError, match=f"^no committed checkpoint under {durable}: .*'s1'.*incomplete .*{lost}"
        ):
            resume_from_checkpoint(durable, model=_linear(9), local_path=local)
    shutil.rmtree(local)  # the whole fast tier lost
    with pytest.raises(
        CheckpointError, match=f"^no committed checkpoint under {durable} nor in the fast tier {local}$"
    ):
        resume_from_checkpoint(durable, model=_linear(9), local_path=local)


@pytest.mark.parametrize("missing_ok", [False, True])
def test_a_damaged_newest_in_path_beside_an_incomplete_fast_copy_is_corrupt_not_missing(
    tmp_path: Path, missing_ok: bool
) -> None:
    """rev68a F1: path's newest, damaged, and the fast tier's copy of it incomplete: the incomplete copy's
    "no committed checkpoint" (CheckpointNotFound, which a caller may take for a fresh start) came first."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    save_checkpoint(durable, "s1", model=_linear(1), local_path=local, replicas=1, durable_every=1)
    wait_for_saves()  # drained
    folder = _job(local, durable) / "s1_partial"
    (folder / sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))[0]).unlink()
    (durable / "s1_partial" / "smpckpt.manifest.json").write_text("{not json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointCorrupt, match=f"^{durable}/newest names 's1', which is corrupt"):
            resume_from_checkpoint(durable, model=_linear(9), local_path=local, missing_ok=missing_ok)


def test_a_state_that_does_not_fit_the_newest_save_is_refused_not_resumed_from_an_older_one(tmp_path: Path) -> None:
    """s2 saved after the model went bf16; the restarted code builds it fp32. Without the fast tier the
    resume refuses (the dtype, by key); with it, the "this copy failed, try the next" fallback meant for
    damaged copies loaded the older s1, with only a warning. Now refused alike."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1 = _linear(1)
    save_checkpoint(durable, "s1", model=m1, local_path=local, replicas=1, durable_every=5)
    save_checkpoint(durable, "s2", model=_linear(2).to(torch.bfloat16), local_path=local, replicas=1, durable_every=5)
    got = _linear(9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(LayoutMismatch, match="saved as torch.bfloat16 but the destination is torch.float32"):
            resume_from_checkpoint(durable, model=got, local_path=local)
    assert not _same(got, m1)


def test_tag_asked_for_comes_from_the_durable_tier_when_saved_there_again_after_the_fast_copy(tmp_path: Path) -> None:
    """A tag saved through the fast tier, then saved again in ``path`` (``overwrite=True``, by a job
    without the fast tier): the fast tier still holds the older save of that tag. A resume of that tag
    takes the newer durable one, as a resume of the newest does (it once took the fast copy, silently)."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    m1, m2 = _linear(1), _linear(2)
    save_checkpoint(durable, "final", model=m1, local_path=local, replicas=1)
    wait_for_saves()
    save_checkpoint(durable, "final", model=m2, overwrite=True)
    for tag in (None, "final"):
        got = _linear(9)
        resume_from_checkpoint(durable, tag=tag, model=got, local_path=local)
        info = last_resume_info()
        assert info is not None and (info.tag, info.tier) == ("final", "durable"), (tag, info)
        assert _same(got, m2), tag


def _abandoned_fast_history(tmp_path: Path) -> tuple[Path, FastTier, dict[str, nn.Module]]:
    """Job A (fast tier, durable_every=3) saves s1..s5: only s3 reaches path. Job B, without the fast
    tier, resumes s3 from path and saves b1 -- numbered after path's s3 only, so below A's s5."""
    durable = tmp_path / "durable"
    fast = FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=3)
    models = {f"s{s}": _linear(s) for s in range(1, 6)} | {"b1": _linear(100)}
    with Checkpointer(durable, fast_tier=fast) as a:
        for s in range(1, 6):
            a.save(f"s{s}", models[f"s{s}"])
    with Checkpointer(durable) as b:
        got = _linear(99)
        b.resume(model=got)
        assert b.last_resume_info is not None and b.last_resume_info.tag == "s3"
        assert _same(got, models["s3"])
        b.save("b1", models["b1"])
    return durable, fast, models


def test_a_fast_tier_history_a_job_without_it_abandoned_is_refused_by_name(tmp_path: Path) -> None:
    """tag=None with the fast tier again: its s5 (sequence 5) outranks b1 (4), but b1 continued the run
    and s5's job never saw it. Neither number nor clock says which history the user continues: refused,
    naming both (it once resumed the abandoned s5, silently); tag= picks either, bit-exact."""
    durable, fast, models = _abandoned_fast_history(tmp_path)
    with Checkpointer(durable, fast_tier=fast) as c:
        with pytest.raises(
            CheckpointError,
            match=r"ambiguous resume.*'s5' \(sequence number 5\).*'b1', sequence "
            r"number 4.*resume\(tag='b1'\).*resume\(tag='s5'\)",
        ):
            c.resume(model=_linear(99))
        for tag, tier in (("b1", "durable"), ("s5", "fast")):
            got = _linear(99)
            c.resume(tag=tag, model=got)
            info = c.last_resume_info
            assert info is not None and (info.tag, info.tier) == (tag, tier)
            assert _same(got, models[tag])


def test_a_fast_tier_history_continued_from_the_durable_one_resumes_as_before(tmp_path: Path) -> None:
    """After tag='b1' chose path's history, the fast tier's next save c1 knew b1: tag=None takes it again,
    and when c1 cannot be loaded the abandoned s5 is no fallback: path's b1 is (it once was s5, silently).
    A job that enables a fast tier on a root of plain saves (resuming one, or starting afresh) resumes
    its fast-tier saves as before."""
    durable, fast, models = _abandoned_fast_history(tmp_path)
    fast = FastTier(local_path=fast.local_path, replicas=1, durable_every=10)  # c1 stays in the fast tier
    with Checkpointer(durable, fast_tier=fast) as c:
        c.resume(tag="b1", model=_linear(99))
        models["c1"] = _linear(101)
        c.save("c1", models["c1"])
    local = _job(Path(fast.local_path), durable)
    # num_kept_local=2: the abandoned s5 stays, uncounted (as path's retention: fix72e); s4, which no save
    # records as abandoned, fills the second slot (the next save removes it)
    assert _partials(local) == ["c1_partial", "s4_partial", "s5_partial"]
    for broken in (False, True):
        if broken:  # one node: no intact copy anywhere, the fast copy of c1 fails
            data = next(p for p in (local / "c1_partial").iterdir() if p.name.endswith(".distcp"))
            data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 0xFF]))
        with Checkpointer(durable, fast_tier=fast) as c, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = _linear(99)
            c.resume(model=got)
            info = c.last_resume_info
        want = "b1" if broken else "c1"
        assert info is not None and (info.tag, info.tier) == (want, "durable" if broken else "fast")
        assert _same(got, models[want])

    plain = tmp_path / "plain"
    with Checkpointer(plain) as p:
        p.save("p1", _linear(1))
    for resumed in (True, False):
        tier = FastTier(local_path=str(tmp_path / f"fast-{resumed}"), replicas=1, durable_every=3)
        with Checkpointer(plain, fast_tier=tier) as f:
            if resumed:
                f.resume(model=_linear(99))
            f.save(f"f-{resumed}", _linear(2))
        with Checkpointer(plain, fast_tier=tier) as f:
            got = _linear(99)
            f.resume(model=got)
            info = f.last_resume_info
            assert info is not None and (info.tag, info.tier) == (f"f-{resumed}", "fast")
            assert _same(got, _linear(2))


def test_a_plain_writer_of_the_root_beside_a_tiered_one_in_one_process_is_no_divergence(tmp_path: Path) -> None:
    """Two Checkpointers of one root in one process, one with the fast tier: p2 (plain) is saved between
    the fast-only s1 and s3. s3's draw read p2's number from ``newest``, so s3 knew it: tag=None resumes
    s3 as before, not refused."""
    durable, fast = tmp_path / "durable", FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=5)
    models = {tag: _linear(i) for i, tag in enumerate(("s1", "p2", "s3"), 1)}
    with Checkpointer(durable, fast_tier=fast) as a, Checkpointer(durable) as b:
        a.save("s1", models["s1"])
        b.save("p2", models["p2"])
        a.save("s3", models["s3"])
    assert _tier_record(_job(Path(fast.local_path), durable) / "s3_partial")["path_seen"] == 1  # p2's number
    with Checkpointer(durable, fast_tier=fast) as c:
        got = _linear(99)
        c.resume(model=got)
        info = c.last_resume_info
    assert info is not None and (info.tag, info.tier) == ("s3", "fast")
    assert _same(got, models["s3"])


# -- 2 nodes x 2 ranks -------------------------------------------------------------------------------
# Spawning 4 ranks costs ~9 s on 2 cores: one world runs every case without a killed rank, one world
# per kill, one world resumes both killed jobs, one 2-rank world reshards.
def test_lineage_skips_what_the_job_saw_and_left_and_ends_at_path() -> None:
    """(pure logic, rev58c) A rewind by tag wrote "fork-seen", which switched the fork check off for 16
    saves: a later real fork resumed the abandoned history silently. A save after a resume from ``path``
    had an empty lineage, and the heal then refused same-history stale copies, falling back to an older
    save. Now the numbers a job saw and did not go on from are skipped, the rest stays checked, and a
    lineage ends where ``path``'s checkpoint was gone on from."""
    from smpckpt.api._fast_resume import lineage_for, refuse_forked
    from smpckpt.api._tiers import PATH_MARK, SKIPPED, LocalCopy, candidates

    def copy(seq: int, lineage: tuple[int, ...] = (), history: int = 1000) -> LocalCopy:
        return LocalCopy("committed", {}, history + seq, seq, (seq, seq, ""), {}, lineage=lineage)

    saves: dict[str, LocalCopy] = {}
    for seq in range(1, 8):  # s1..s7, each numbered after the one before
        saves[f"s{seq}"] = copy(seq, lineage_for([saves], 0, None))
    assert saves["s7"].lineage == tuple(range(1006, 1000, -1))
    s8 = copy(8, lineage_for([saves], 0, saves["s6"].digest))  # the job rewound to s6 by tag
    assert s8.lineage == (SKIPPED, 1006, 1005, 1004, 1003, 1002, 1001)
    s9 = copy(9, lineage_for([{**saves, "s8": s8}], 0, s8.digest))
    views = [{"s8": s8, "s9": s9}]
    refuse_forked(candidates(views)[0], candidates(views))  # nothing else at its numbers: no fork
    forked = [
        {**views[0], "new6": copy(6, history=2000)}
    ]  # another history's save 6 (the fast tiers lost, path's s5 resumed)
    with pytest.raises(CheckpointError, match=r"two histories of this job: 's9' \(save 9\) and 'new6' \(save 6\)"):
        refuse_forked(candidates(forked)[0], candidates(forked))
    # after a resume from path's save 4 the next save's lineage ends there; stale saves 3, 4 of the same
    # history back on a node are no fork
    x5 = copy(5, lineage_for([{}], 4, PATH_MARK))
    c6 = copy(6, lineage_for([{"x5": x5}], 4, x5.digest))
    assert (x5.lineage, c6.lineage) == ((), (1005,))
    back = [{"x5": x5, "c6": c6, "c3": copy(3), "a4": copy(4)}]
    refuse_forked(candidates(back)[0], candidates(back))


def _raising(sd: Any) -> Any:
    raise RuntimeError("translate_function failed")


def test_a_fast_tier_resume_by_tag_marks_a_rollback_only_once_it_succeeded(tmp_path: Path) -> None:
    """rev60a F1, fast tier: a resume of s3 from the fast tier that failed (a raising translate_function)
    marked a roll-back: s6 recorded s4, s5 abandoned. The same resume, succeeding, marks it (s7)."""
    durable = tmp_path / "durable"
    fast = FastTier(local_path=str(tmp_path / "fast"), replicas=1, durable_every=1, num_kept_local=None)
    models = {s: _linear(s) for s in range(1, 8)}
    with Checkpointer(durable, fast_tier=fast) as c:
        for s in range(1, 6):
            c.save(f"s{s}", models[s])
        with pytest.raises(RuntimeError, match="translate_function failed"):
            c.resume(tag="s3", model=_linear(99), options=ResumeOptions(translate_function=_raising))
        c.save("s6", models[6])
        got = _linear(99)
        c.resume(tag="s3", model=got)
        info = c.last_resume_info
        assert info is not None and (info.tag, info.tier) == ("s3", "fast")
        assert _same(got, models[3])
        c.save("s7", models[7])
    assert "abandoned" not in read_manifest(str(durable / "s6_partial")).extra
    assert read_manifest(str(durable / "s7_partial")).extra["abandoned"] == [[4, 6]]


def test_a_fast_tier_rollback_is_recorded_beside_newest_and_never_resumed_past(tmp_path: Path) -> None:
    """rev60c F1, F2: the drain of a save after a roll-back (s3; s4, s5 abandoned) left no root copy of the
    record, and with s6 damaged in both tiers a tag-less resume loaded the abandoned s5 from the fast tier
    (``ls --local`` predicting it) while the warning named s3. Now s3 loads, as warned, bit-exact."""
    import io
    import json

    from smpckpt.tools.cli import main

    durable, local = tmp_path / "durable", tmp_path / "fast"
    fast = FastTier(local_path=str(local), replicas=1, durable_every=1, num_kept_local=None)
    models = {s: _linear(s) for s in range(1, 7)}
    with Checkpointer(durable, fast_tier=fast) as c:
        for s in range(1, 6):
            c.save(f"s{s}", models[s])
        c.resume(tag="s3", model=_linear(99))
        c.save("s6", models[6])
    record = json.loads((durable / "smpckpt.abandoned").read_text())
    assert record == {"tag": "s6", "sequence": 6, "abandoned": [[4, 5]]}
    (durable / "s6_partial" / "smpckpt.manifest.json").write_text("{not json")
    got = _linear(99)
    with Checkpointer(durable, fast_tier=fast) as c, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c.resume(model=got)  # s6 intact in the fast tier: it loads, and no warning says s3 is resumed
        info = c.last_resume_info
    assert info is not None and (info.tag, info.tier) == ("s6", "fast") and _same(got, models[6])
    assert not [w for w in caught if "resuming from the newest committed checkpoint" in str(w.message)]
    (_job(local, durable) / "s6_partial" / "smpckpt.manifest.json").write_text("{not json")
    out = io.StringIO()
    main(["ls", str(durable), "--local", str(local)], stdout=out, stderr=io.StringIO())
    assert out.getvalue().splitlines()[-1] == "resume: s3 from the fast tier", out.getvalue()
    got = _linear(99)
    with Checkpointer(durable, fast_tier=fast) as c, pytest.warns(UserWarning) as caught:
        c.resume(model=got)
        info = c.last_resume_info
    assert info is not None and info.tag == "s3" and _same(got, models[3])
    said = [str(w.message) for w in caught if "resuming from the newest committed checkpoint" in str(w.message)]
    assert len(said) == 1 and "'s3'" in said[0] and "['s5', 's4']" in said[0], said
    assert f"as {durable}/smpckpt.abandoned records" in said[0]


def test_the_fast_tier_fallbacks_skip_what_a_newer_save_or_paths_choice_abandoned() -> None:
    """rev60c F2: the fast tier's candidates after a roll-back to s4 (s6 recording s5 abandoned; s5 and s6
    undrained, path's newest s4): when s6 fails to load, s5 was the next fallback. Neither it nor, with
    path's choice s3 (its ranges naming s4-s5), any save its history abandoned is one; tag= names any."""
    from smpckpt.api._fast_resume import usable_saves
    from smpckpt.api._resume import Target
    from smpckpt.api._tiers import FastCandidate
    from smpckpt.storage.format.manifest import Manifest, MetadataRecord

    def cand(seq: int, abandoned: tuple[tuple[int, int], ...] = ()) -> FastCandidate:
        return FastCandidate(f"s{seq}", seq, seq, (seq, 0, ""), {}, (), abandoned=abandoned)

    found = [cand(6, ((5, 5),)), cand(5), cand(4), cand(3)]
    path_s4 = Target("s4", "path/s4_partial", None, None, False, False, (4, 0, ""))
    assert [c.tag for c in usable_saves(found, path_s4, None)] == ["s6", "s4"]
    path_s3 = Target("s3", "path/s3_partial", None, None, False, True, (3, 0, ""), abandoned=((4, 5),))
    assert [c.tag for c in usable_saves(found[1:], path_s3, None)] == ["s3"]
    assert [c.tag for c in usable_saves(found[1:2], path_s3, "s5")] == ["s5"]
    # a record of numbers not below its own save's is ignored there (crafted): it hid the newer fast saves
    extra = {"sequence": 4, "abandoned": [[5, 9], [1, 2]]}
    crafted = Manifest("id-s4", "partial", "raw", MetadataRecord(".metadata", 0, 0), (), 1, "", extra)
    path_crafted = Target.of("s4", "path/s4_partial", crafted, False)
    assert path_crafted.abandoned == ((1, 2),)
    assert [c.tag for c in usable_saves([cand(6), cand(5)], path_crafted, None)] == ["s6", "s5"]


def test_histories_are_told_apart_by_their_segments_never_by_save_times() -> None:
    """rev63c: beyond the 16-save lineage, a fork is told by ``runs`` (segments: id, first number). A, B, C
    segments; B left A at 6. A's save 24 (a node back with an old disk) is past where B's history left A:
    refused either way round. Two histories leaving A at 6 for two segments (a restart at 6 on each
    side): refused. A roll-back (A's 5 below B's first 6), a save without runs, or a history that passed
    over the other (saw it, went on elsewhere) is not."""
    from smpckpt.api._tiers import FastCandidate, apart, runs_of

    def save(seq: int, runs: list[tuple[int, int]], passed: tuple[tuple[int, int], ...] = ()) -> FastCandidate:
        return FastCandidate(f"s{seq}", seq, seq, (seq, 0, ""), {}, (), runs=tuple(runs), passed=passed)

    a_, b_, c_, d_ = 0xA, 0xB, 0xC, 0xD
    a24, b30 = save(24, [(a_, 1)]), save(30, [(a_, 1), (b_, 6)])
    assert apart(b30, a24) and apart(a24, save(6, [(a_, 1), (b_, 6)]))
    assert apart(save(24, [(a_, 1), (c_, 6)]), save(6, [(a_, 1), (b_, 6)]))  # siblings at 6
    assert not apart(save(6, [(a_, 1), (b_, 6)]), save(5, [(a_, 1)]))  # a roll-back to A's 4: 5 abandoned
    # B's 6-10 rolled back to A's 5: the roll-back's job saw B's 10 (it numbered 11 after it) and passed it
    assert not apart(save(12, [(a_, 1), (c_, 11)], ((b_, 10),)), save(10, [(a_, 1), (b_, 6)]))
    # rev63g F1: A left for B at 8 (an ordinary restart) and, by a job that never saw B's saves, for C at 6
    assert apart(save(24, [(a_, 1), (b_, 8)]), save(6, [(a_, 1), (c_, 6)]))
    assert apart(save(6, [(a_, 1), (c_, 6)]), save(24, [(a_, 1), (b_, 8)]))
    assert not apart(b30, save(24, []))  # an older copy: the lineage alone
    assert not apart(save(31, [(a_, 1), (b_, 6), (d_, 31)], ((a_, 24),)), a24)  # settled: seen, passed over
    assert runs_of([["000000000000000a", 1], ["0b", 6]]) == ((a_, 1), (b_, 6))
    assert runs_of([["zz", 1]]) == runs_of([["0a", True]]) == runs_of("x") == ()  # damaged: no evidence


def test_each_save_says_how_many_abandoned_saves_the_fast_tier_keeps(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """rev72e LOW-2: fast-tier retention keeps every save a roll-back abandoned, uncounted and never removed
    (65c8d35, as path's), and nothing said so: a job rolling back often filled /dev/shm silently. Now each
    save that keeps any warns once (each node's first rank; not again after its drain), naming how many, the
    newest few, their size and how to remove them; once per growth of that set, not again at each later save."""
    durable, local = tmp_path / "durable", tmp_path / "fast"
    fast = FastTier(local_path=str(local), replicas=1, durable_every=2, num_kept_local=1)
    said: list[list[str]] = []
    with Checkpointer(durable, fast_tier=fast) as c, caplog.at_level(logging.WARNING, logger="smpckpt.api"):
        for tag in ("s1", "s2", "s3", "back", "s4", "s5"):
            caplog.clear()
            if tag == "back":
                c.resume(tag="s2", model=_linear(99))  # s3 abandoned by the next save
            else:
                c.save(tag, _linear(int(tag[1])))
                c.wait()  # its drain too
            said.append([r.getMessage() for r in caplog.records if "as abandoned" in r.getMessage()])
    job = _job(local, durable)
    assert _partials(job) == ["s3_partial", "s5_partial"]
    size = sum(p.stat().st_size for p in (job / "s3_partial").iterdir()) / 2**20
    want = (
        f"fast tier {job}: keeps 1 checkpoint(s) a newer save records as abandoned (a roll-back by tag=, or saves "
        f"the job went on past), 's3', {size:.1f} MiB on this node: retention neither counts nor removes them, so "
        "each roll-back adds to them (on /dev/shm they hold memory). Remove those no longer wanted by hand, on every "
        f"node, e.g. `rm -r {job}/s3_partial`"
    )
    assert said == [[], [], [], [], [want], []], said  # rev72m L: once per growth (was [want] again at s5)
