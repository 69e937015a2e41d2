"""``smpckpt ls`` / ``smpckpt verify`` with ``--local``: both tiers of tiered checkpoints (issue 36).

Real tiered saves: a one-node fast tier from a single process (cheap), node folders split by hand from
it, and one 4-rank world (2 nodes of 2 ranks, gloo) whose node folders hold replicas, or not.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from typing import Any

import pytest
import torch
import tp_model
from dist_harness import run_world
from torch import nn

from smpckpt import ParallelLayout, save_checkpoint, wait_for_saves
from smpckpt.api._tiers import durable_key, job_folder
from smpckpt.storage import Manifest, read_manifest
from smpckpt.tools.cli import main

MANIFEST = "smpckpt.manifest.json"
FAST_HEADER = ["TAG", "SEQ", "COMMITTED", "PARTS", "STATE", "DURABLE", "SIZE", "SAVED"]


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _manifest(folder: str) -> Manifest:
    with open(os.path.join(folder, MANIFEST), "rb") as f:
        return Manifest.from_bytes(f.read())


def _j(node: str, root: str) -> str:
    """The job folder of the durable root ``root`` in the node folder ``node``."""
    return job_folder(node, durable_key(root, None))


def _fast_rows(out: str) -> list[list[str]]:
    """The fast-tier table's rows (split on whitespace), after its header."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == FAST_HEADER) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(("resume:", "note:", "warning:"))), None)
    return [line.split() for line in lines[start:end]]


def _retag(src: str, dst: str, tag: str) -> None:
    """``src``'s manifest written to ``dst`` as a save of ``tag`` (its own checksum recomputed)."""
    from smpckpt.storage.format.manifest import _DIGEST_KEY, _self_digest

    with open(src) as f:
        obj = json.load(f)
    obj.pop(_DIGEST_KEY)
    obj["extra"]["tag"] = tag
    obj[_DIGEST_KEY] = f"{_self_digest(obj):016x}"
    with open(dst, "w") as f:
        json.dump(obj, f)


def _flip_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


# -- one node, one process -----------------------------------------------------------------------------
@pytest.fixture
def tiered(tmp_path: Any) -> tuple[str, str]:
    """(durable root, node folder): step1..3 saved with a fast tier, durable_every=2 -> PATH holds step2,
    the fast tier step2 and step3 (num_kept_local=2)."""
    root, node = str(tmp_path / "run"), str(tmp_path / "node0")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    for i in (1, 2, 3):
        save_checkpoint(root, f"step{i}", model=m, local_path=node, replicas=1, durable_every=2)
    wait_for_saves()
    assert sorted(os.listdir(root)) == ["newest", "step2_partial"]
    assert sorted(n for n in os.listdir(_j(node, root)) if n.endswith("_partial")) == ["step2_partial", "step3_partial"]
    return root, node


def test_ls_local_lists_the_fast_tier_and_the_resume_pick(tiered: tuple[str, str]) -> None:
    root, node = tiered
    n = len(_manifest(f"{_j(node, root)}/step3_partial").files) + 1  # data files + the generation's metadata
    rc, out, err = _run("ls", root, "--local", node)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["TAG", "SEQ", "STATE", "SIZE", "LAYOUT", "SAVED"]
    assert lines[1].split()[:4] == ["*", "step2", "2", "committed"]  # the durable table as without --local
    assert lines[2] == f"fast tier (1 folder(s): {node}), newest first:"
    assert _fast_rows(out) == [
        [">", "step3", "3", "1/1", f"{n}/{n}", "complete", "no", *_fast_rows(out)[0][7:]],
        ["step2", "2", "1/1", f"{n}/{n}", "complete", "yes", *_fast_rows(out)[1][6:]],
    ]
    assert lines[-1] == "resume: step3 from the fast tier"

    rc, plain_out, _ = _run("ls", root, "--json")
    plain = json.loads(plain_out)
    assert "fast" not in plain and "resume" not in plain  # without --local: the JSON of before
    rc, out, _ = _run("ls", root, "--local", node, "--json")
    doc = json.loads(out)
    assert {k: doc[k] for k in ("path", "newest", "checkpoints", "abandoned_by")} == plain  # the durable part
    step3 = _manifest(f"{_j(node, root)}/step3_partial")
    assert doc["resume"] == {"tier": "fast", "tag": "step3", "save_id": step3.save_id}
    assert doc["fast"]["folders"] == [node]
    got = [
        {k: row[k] for k in ("tag", "state", "resume", "seq", "committed_in", "parts_held", "missing", "durable")}
        for row in doc["fast"]["checkpoints"]
    ]
    assert got == [
        dict(
            tag="step3",
            state="complete",
            resume=True,
            seq=3,
            committed_in=[node],
            parts_held=n,
            missing=[],
            durable="no",
        ),
        dict(
            tag="step2",
            state="complete",
            resume=False,
            seq=2,
            committed_in=[node],
            parts_held=n,
            missing=[],
            durable="yes",
        ),
    ]
    assert doc["fast"]["checkpoints"][0]["size"] == step3.total_bytes
    assert doc["fast"]["checkpoints"][0]["holds"] == {node: n}


def test_ls_resume_picks_the_durable_tier_when_it_is_newer(tiered: tuple[str, str]) -> None:
    root, node = tiered
    save_checkpoint(root, "step4", model=nn.Linear(2, 2))  # no fast tier: PATH only, saved last
    rc, out, _ = _run("ls", root, "--local", node)
    assert rc == 0
    lines = out.splitlines()
    assert lines[2].split()[:2] == ["*>", "step4"]  # newest and the resume pick
    assert [row[0] for row in _fast_rows(out)] == ["step3", "step2"]  # no '>' in the fast tier
    assert lines[-1] == f"resume: step4 from {root} (durable)"


def test_verify_local_checks_the_fast_copy_and_the_durable_one(tiered: tuple[str, str]) -> None:
    root, node = tiered
    m3 = _manifest(f"{_j(node, root)}/step3_partial")
    nfiles = len(m3.files)
    rc, out, err = _run("verify", f"{root}/step3", "--local", node)  # only in the fast tier
    assert rc == 0, err
    assert out.splitlines()[:3] == [
        f"durable: {root} holds no committed 'step3' (missing): only the fast tier's copy is verified",
        f"fast tier: step3 (save {m3.save_id}, seq 3) in 1 folder(s):",
        f"  {node}: committed; {nfiles}/{nfiles} data files (all of rank 0), metadata",
    ]
    assert out.splitlines()[3].startswith(f"OK fast tier step3: complete; {nfiles + 1} file copies, ")

    rc, out, err = _run("verify", f"{root}/step2", "--local", node)  # in both tiers: both verified
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"OK {root}/step2_partial: {nfiles + 1} files")
    assert lines[-1].startswith("OK fast tier step2: complete;")

    # the tag exported in full too: --local verifies the durable partial save beside the fast tier's (which holds
    # partial saves alone), not refused as two checkpoints nor the full export for PATH/TAG/ (rev71d L2)
    save_checkpoint(root, "step2", partial=False, model=nn.Linear(2, 2))
    for spec in ("step2", "step2/", "step2_partial"):
        rc, out, err = _run("verify", f"{root}/{spec}", "--local", node)
        assert rc == 0 and out.splitlines()[0].startswith(f"OK {root}/step2_partial: {nfiles + 1} files"), (spec, err)

    # a tag held only as a committed full export (no durable partial save, the fast tier not holding it): --local
    # verifies that folder, as before aa0e5ba (rev71h M3: refused as "in neither tier"); beside a partial save that
    # did not finish (files without a manifest) that failed save is reported, not hidden behind the export (rev71h2 L1)
    save_checkpoint(root, "final", partial=False, model=nn.Linear(2, 2))
    full_files = len(_manifest(f"{root}/final").files) + 1
    for spec in ("final", "final/"):
        rc, out, err = _run("verify", f"{root}/{spec}", "--local", node)
        lines = out.splitlines()
        assert rc == 0 and lines[0].startswith(f"OK {root}/final: {full_files} files, "), (spec, out, err)
        assert lines[1:] == ["fast tier: 'final' is in none of the 1 folder(s)"], (spec, out)
    os.makedirs(f"{root}/final_partial")
    with open(f"{root}/final_partial/__0_0.distcp", "wb") as f:
        f.write(b"x")
    for spec in ("final", "final/"):
        rc, _, err = _run("verify", f"{root}/{spec}", "--local", node)
        assert rc == 1 and f"nothing committed at {root}/final_partial (uncommitted)" in err, (spec, err)
    for spec in ("nothing", "final_partial"):  # a tag in no tier; the partial save named: still refused
        rc, _, err = _run("verify", f"{root}/{spec}", "--local", node)
        assert rc == 1 and f"is in neither tier: nothing committed at {root}/{spec.split('_')[0]}_partial" in err, err


def test_verify_local_names_a_corrupt_byte_in_a_fast_tier_file(tiered: tuple[str, str]) -> None:
    root, node = tiered
    folder = f"{_j(node, root)}/step2_partial"
    files = _manifest(folder).files
    name = sorted(f.name for f in files)[0]
    _flip_byte(f"{folder}/{name}")
    rc, out, err = _run("verify", f"{root}/step2", "--local", node)
    assert rc == 1
    assert out.splitlines()[0].startswith(f"OK {root}/step2_partial:")  # the durable copy is intact
    assert f"  {node}: committed; {len(files) - 1}/{len(files)} data files, metadata; 1 problem(s)\n" in out
    assert f"FAILED fast tier step2: 2 problem(s)\n  {folder}/{name}: checksum mismatch in bytes " in err
    assert f"no folder holds {name} (rank 0's data file) intact" in err
    assert _run("verify", f"{root}/step2")[0] == 0  # without --local: the durable copy only, as before


def test_verify_local_reports_the_fast_tier_when_the_durable_copy_is_removed_meanwhile(
    tiered: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev73e 3: verify --local checked the fast tier first, then the durable copy; a durable copy removed
    (retention, prune) while verify read it raises "was removed ... verify again" (hunt73b), which escaped
    _cmd_verify before the fast tier's report was written: a damaged fast-tier file found in that run was
    never named. Now the durable error is its verdict (exit 1) and the fast tier's report follows."""
    from smpckpt.storage import remove_checkpoint
    from smpckpt.tools import cli

    root, node = tiered
    folder = f"{_j(node, root)}/step2_partial"
    name = sorted(f.name for f in _manifest(folder).files)[0]
    _flip_byte(f"{folder}/{name}")
    real, fired = cli.verify_checkpoint, []

    def racing(url: str, options: Any = None, progress: Any = None) -> Any:  # the real verify, raced
        def meanwhile(done: int, total: int) -> None:  # once the metadata is checked: another job's prune
            if not fired:
                fired.append(done)
                remove_checkpoint(url)

        return real(url, options, progress=meanwhile)

    monkeypatch.setattr(cli, "verify_checkpoint", racing)
    rc, out, err = _run("verify", f"{root}/step2", "--local", node)
    assert fired and rc == 1, (rc, out, err)
    assert f"FAILED {root}/step2_partial: 1 problem(s)\n  {root}/step2_partial was removed" in err, err
    assert "verify again" in err, err
    assert f"FAILED fast tier step2: 2 problem(s)\n  {folder}/{name}: checksum mismatch in bytes " in err, err
    assert f"  {node}: committed; " in out, out


def _split(
    node: str, base: str, tag: str, a_names: list[str] | None, root: str
) -> tuple[str, str, list[str], list[str]]:
    """Two hand-made node folders A and B of ``tag``'s one-node copy: A holds ``a_names`` (default: the
    first half of the data files) and the metadata, B the other data files (all of them when
    ``a_names`` is given); both hold the manifest."""
    src = f"{_j(node, root)}/{tag}_partial"
    m = _manifest(src)
    names = sorted(f.name for f in m.files)
    first = a_names if a_names is not None else names[: len(names) // 2]
    second = names if a_names is not None else names[len(names) // 2 :]
    dirs = []
    for label, held in (("A", first + [m.metadata.name, ".metadata"]), ("B", second)):
        d = os.path.join(base, label)
        os.makedirs(f"{_j(d, root)}/{tag}_partial")
        for n in held + [MANIFEST]:
            shutil.copy2(f"{src}/{n}", f"{_j(d, root)}/{tag}_partial/{n}")
        dirs.append(d)
    return dirs[0], dirs[1], first, second


def test_two_folders_complete_together_and_missing_without_one(tiered: tuple[str, str], tmp_path: Any) -> None:
    root, node = tiered
    a, b, first, second = _split(node, str(tmp_path / "split"), "step3", None, root)
    n = len(first) + len(second) + 1
    rc, out, _ = _run("ls", root, "--local", a, b)
    assert _fast_rows(out) == [[">", "step3", "3", "2/2", f"{n}/{n}", "complete", "no", *_fast_rows(out)[0][7:]]]
    rc, out, err = _run("verify", f"{root}/step3", "--local", a, b)
    assert rc == 0, err
    assert f"  {a}: committed; {len(first)}/{n - 1} data files, metadata\n" in out
    assert f"  {b}: committed; {len(second)}/{n - 1} data files, no metadata\n" in out

    shutil.rmtree(f"{_j(b, root)}/step3_partial")  # node B lost its copy; A holds no replicas of B's files
    rc, out, _ = _run("ls", root, "--local", a, b)
    held = len(first) + 1
    assert _fast_rows(out) == [
        ["step3", "3", "1/2", f"{held}/{n}", "missing", str(len(second)), "no", *_fast_rows(out)[0][7:]]
    ]
    assert out.splitlines()[-1] == f"resume: step2 from {root} (durable)"
    rc, out, err = _run("verify", f"{root}/step3", "--local", a, b)
    assert rc == 1
    assert f"  {b}: absent\n" in out
    assert [line for line in err.splitlines() if "no folder holds" in line] == [
        f"  step3: no folder holds {name} (rank 0's data file) intact: the fast-tier copy is incomplete"
        for name in second
    ]


def test_a_folder_holding_replicas_keeps_the_tag_complete(tiered: tuple[str, str], tmp_path: Any) -> None:
    root, node = tiered
    a, b, first, second = _split(node, str(tmp_path / "split"), "step3", [], root)  # B holds every data file
    shutil.rmtree(f"{_j(a, root)}/step3_partial")  # A (with the metadata) lost: the metadata is gone too
    rc, out, _ = _run("ls", root, "--local", a, b)
    assert _fast_rows(out)[0][:5] == ["step3", "3", "1/2", f"{len(second)}/{len(second) + 1}", "missing"]
    shutil.copy2(
        f"{_j(node, root)}/step3_partial/{_manifest(_j(b, root) + '/step3_partial').metadata.name}",
        f"{_j(b, root)}/step3_partial/",
    )
    rc, out, _ = _run("ls", root, "--local", a, b)
    assert _fast_rows(out)[0][:6] == [">", "step3", "3", "1/2", f"{len(second) + 1}/{len(second) + 1}", "complete"]
    rc, out, err = _run("verify", f"{root}/step3", "--local", a, b)
    assert rc == 0, err
    assert f"  {a}: absent\n  {b}: committed; {len(second)}/{len(second)} data files (all of rank 0), metadata\n" in out


def test_folders_whose_manifests_disagree_fail_verify(tiered: tuple[str, str], tmp_path: Any) -> None:
    root, node = tiered
    a, b, _, _ = _split(node, str(tmp_path / "split"), "step3", None, root)
    # another save of step3 (step2's manifest under this tag, its digest recomputed)
    _retag(f"{_j(node, root)}/step2_partial/{MANIFEST}", f"{_j(b, root)}/step3_partial/{MANIFEST}", "step3")
    old, new = _manifest(f"{_j(node, root)}/step2_partial"), _manifest(f"{_j(node, root)}/step3_partial")
    rc, out, _ = _run("ls", root, "--local", a, b)
    # completeness goes by the files the folders hold, as resume judges it: step3's are all there
    n_new, n_old = len(new.files) + 1, len(old.files) + 1
    assert [row[:6] for row in _fast_rows(out)] == [
        [">", "step3", "3", "1/2", f"{n_new}/{n_new}", "complete"],
        ["step3", "2", "1/2", f"0/{n_old}", "missing", str(n_old)],
    ]
    assert "warning: step3: the folders hold 2 different committed saves of this tag" in out
    rc, out, err = _run("verify", f"{root}/step3", "--local", a, b)
    assert rc == 1
    assert f"  {b}: other save;" in out
    assert (
        f"  {b}: its manifest of 'step3' (save {old.save_id}) differs from the newest one the folders hold "
        f"(save {new.save_id})"
    ) in err


def test_a_corrupt_fast_tier_manifest_is_named(tiered: tuple[str, str]) -> None:
    root, node = tiered
    path = f"{_j(node, root)}/step3_partial/{MANIFEST}"
    _flip_byte(path)
    rc, out, _ = _run("ls", root, "--local", node)
    assert rc == 0
    assert _fast_rows(out)[0][:2] == [">", "step2"]  # the corrupt copy is not a resume candidate
    assert any(row[:1] == ["step3"] and "corrupt" in row for row in _fast_rows(out))
    assert f"warning: {path} is " in out
    rc, out, err = _run("verify", f"{root}/step3", "--local", node)
    assert rc == 1
    assert f"  {node}: corrupt manifest; 1 problem(s)" in out
    assert f"FAILED fast tier step3: 1 problem(s)\n  {path} is " in err


def test_a_file_where_a_fast_copy_folder_would_be_is_a_problem_verify_names(tiered: tuple[str, str]) -> None:
    """rev69a M1: with a path through a file read as absent, a node whose ``{tag}_partial`` is a file read as
    "uncommitted, no files" and ``verify --local`` passed; it is unreadable, naming the file."""
    root, node = tiered
    folder = f"{_j(node, root)}/step3_partial"
    shutil.rmtree(folder)
    with open(folder, "wb") as f:
        f.write(b"not a folder")
    rc, out, err = _run("verify", f"{root}/step3", "--local", node)
    assert rc == 1, (out, err)
    assert f"{folder} is a file, not a folder" in out + err


def test_usage_errors_and_unknown_tags(tiered: tuple[str, str], tmp_path: Any) -> None:
    root, node = tiered
    missing = str(tmp_path / "nowhere")
    for cmd, target in (("ls", root), ("verify", f"{root}/step3")):
        rc, _, err = _run(cmd, target, "--local", node, missing)
        assert (rc, err.splitlines()[0]) == (
            2,
            f"smpckpt {cmd}: --local '{missing}': no such folder (a node's fast tier, the local_path it saved to)",
        )
        rc, _, err = _run(cmd, target, "--local", node, node + "/")
        assert rc == 2 and f"--local '{node}' is the same folder as --local '{node}'" in err
    rc, _, err = _run("verify", f"{root}/step9", "--local", node)
    assert rc == 1
    assert f"CheckpointNotFound: checkpoint 'step9' is in neither tier: nothing committed at {root}/step9" in err
    assert node in err
    rc, _, err = _run("verify", f"{root}/bad*tag", "--local", node)
    assert rc == 2 and "is not PATH/TAG: invalid checkpoint tag 'bad*tag'" in err
    os.makedirs(f"{_j(node, root)}/step7_partial")
    open(f"{_j(node, root)}/step7_partial/x.distcp", "wb").close()  # a save that never committed
    rc, out, _ = _run("ls", root, "--local", node)
    assert ["step7", "-", "0/1", "1/?", "uncommitted", "-", "-", "-"] in _fast_rows(out)
    assert "note: step7 is uncommitted: no folder holds a manifest" in out
    rc, _, err = _run("verify", f"{root}/step7", "--local", node)
    assert rc == 1 and "'step7' is in neither tier" in err and "files without a manifest" in err


# -- two nodes of two ranks ------------------------------------------------------------------------------
LAYOUT = ParallelLayout(tp=2, dp=2)


def two_saves(rank: int, world: int, base: str, durable: str) -> None:
    """(4 ranks, LOCAL_WORLD_SIZE=2) step1 with replicas=2 (each node holds every file), step2 with
    replicas=1 (each node its own ranks'); durable_every=2 drains step2 to ``durable``."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    local = os.path.join(base, f"node{rank // 2}")
    ctx, model, opt = tp_model.build(LAYOUT)
    for step, replicas in ((1, 2), (2, 1)):
        tp_model.train_step(ctx, model, opt, step)
        save_checkpoint(
            durable,
            f"step{step}",
            model=model,
            optimizer=opt,
            layout=LAYOUT,
            specs=tp_model.SPECS,
            local_path=local,
            replicas=replicas,
            durable_every=2,
        )
    wait_for_saves()


@pytest.mark.dist
def test_two_nodes_with_and_without_replicas(tmp_path: Any) -> None:
    base, root = str(tmp_path / "fast"), str(tmp_path / "run")
    run_world(two_saves, 4, base, root, timeout=180)
    node0, node1 = f"{base}/node0", f"{base}/node1"
    m2 = read_manifest(f"{root}/step2_partial")
    n = len(m2.files) + 1
    of = {r: sorted(f.name for f in m2.files if f.rank in r) for r in ((0, 1), (2, 3))}
    rc, out, _ = _run("ls", root, "--local", node0, node1)
    rows = _fast_rows(out)
    assert [r[:7] for r in rows] == [
        [">", "step2", "2", "2/2", f"{n}/{n}", "complete", "yes"],
        ["step1", "1", "2/2", f"{n}/{n}", "complete", "no", rows[1][6]],
    ]
    rc, out, err = _run("verify", f"{root}/step2", "--local", node0, node1)
    assert rc == 0, err
    assert f"  {node0}: committed; {len(of[0, 1])}/{n - 1} data files (all of ranks 0-1), metadata\n" in out
    assert f"  {node1}: committed; {len(of[2, 3])}/{n - 1} data files (all of ranks 2-3), metadata\n" in out

    shutil.rmtree(node1)  # node 1 lost: step1 survives in node 0's replicas, step2 does not
    rc, out, _ = _run("ls", root, "--local", node0)
    rows = _fast_rows(out)
    assert [r[:6] for r in rows] == [
        ["step2", "2", "1/1", f"{n - len(of[2, 3])}/{n}", "missing", str(len(of[2, 3]))],
        ["step1", "1", "1/1", f"{n}/{n}", "complete", "no"],
    ]
    assert out.splitlines()[-1] == f"resume: step2 from {root} (durable)"  # newer than the fast tier's step1
    rc, out, err = _run("verify", f"{root}/step1", "--local", node0)
    assert rc == 0, err
    assert f"  {node0}: committed; {n - 1}/{n - 1} data files (all of ranks 0-3), metadata\n" in out
    rc, out, err = _run("verify", f"{root}/step2", "--local", node0)
    assert rc == 1
    assert out.splitlines()[0].startswith(f"OK {root}/step2_partial:")
    missing = sorted(line.split()[4] for line in err.splitlines() if "no folder holds" in line)
    assert missing == of[2, 3]


def test_ls_local_names_no_resume_pick_where_a_resume_refuses_two_histories(tmp_path: Any) -> None:
    """``ls --local`` printed "resume: <the abandoned save> from the fast tier" where a resume refuses it as
    one of two histories (rev58b F7): s1-s5 (s4 drained), the fast tier lost, path's s4 resumed and n5
    saved (save 5); the old s5 put back beside it: two saves of number 5."""
    from smpckpt import Checkpointer, FastTier
    from smpckpt.errors import CheckpointError

    root, fast = str(tmp_path / "durable"), tmp_path / "fast"
    tier = FastTier(local_path=str(fast), replicas=1, durable_every=4, num_kept_local=None)
    torch.manual_seed(0)
    with Checkpointer(root, fast_tier=tier) as ckpt:
        for step in range(1, 6):
            ckpt.save(f"s{step}", nn.Linear(4, 4))
    job = _j(str(fast), root)
    shutil.copytree(os.path.join(job, "s5_partial"), tmp_path / "s5_old")
    shutil.rmtree(fast)
    model = nn.Linear(4, 4)
    with Checkpointer(root, fast_tier=tier) as ckpt:
        ckpt.resume(model=model)
        assert ckpt.last_resume_info is not None and ckpt.last_resume_info.tag == "s4"
        ckpt.save("n5", model)
    shutil.copytree(tmp_path / "s5_old", os.path.join(job, "s5_partial"))
    rc, out, _ = _run("ls", root, "--local", str(fast))
    assert rc == 0 and "resume: none (a resume would fail: ambiguous resume" in out, out
    with Checkpointer(root, fast_tier=tier) as ckpt, pytest.raises(CheckpointError, match="two histories"):
        ckpt.resume(model=nn.Linear(4, 4))


def test_ls_local_names_no_resume_pick_where_path_holds_another_history(tmp_path: Any) -> None:
    """``ls --local`` named the fast tier's newest save where a resume refuses it: the tiered job saved s1-s5
    (s3 drained to ``path``), then a job without the fast tier resumed ``path``'s s3 and saved y4 (numbered from
    ``path`` alone) -- diverged histories (the resume's ``_same_history``; ls applied only the fork check)."""
    from smpckpt import Checkpointer, FastTier
    from smpckpt.errors import CheckpointError

    root, fast = str(tmp_path / "durable"), str(tmp_path / "fast")
    tier = FastTier(local_path=fast, replicas=1, durable_every=3, num_kept_local=None)
    torch.manual_seed(0)
    with Checkpointer(root, fast_tier=tier) as tiered:
        for step in range(1, 6):
            tiered.save(f"s{step}", nn.Linear(4, 4))
    with Checkpointer(root) as plain:
        plain.resume(model=nn.Linear(4, 4))
        plain.save("y4", nn.Linear(4, 4))
    assert _manifest(os.path.join(root, "y4_partial")).extra["sequence"] == 4
    rc, out, _ = _run("ls", root, "--local", fast)
    assert rc == 0 and "resume: none (a resume would fail: ambiguous resume" in out, out
    doc = json.loads(_run("ls", root, "--local", fast, "--json")[1])
    assert doc["resume"] is None and "diverged histories" in doc["resume_none_because"]
    with Checkpointer(root, fast_tier=tier) as ckpt, pytest.raises(CheckpointError, match="diverged histories"):
        ckpt.resume(model=nn.Linear(4, 4))


@pytest.mark.parametrize("change", ["remove", "replace"])
def test_ls_local_shows_what_it_judged_while_the_fast_tier_changes(
    tiered: tuple[str, str], monkeypatch: Any, change: str
) -> None:
    """``ls --local`` beside a training job: its retention removes a tag, or a new save of a tag commits,
    between the folder scan and the table (rev62f F1: a re-read failed as "malformed", or a KeyError)."""
    import smpckpt.tools._tiers as tiers

    root, node = tiered
    job, real = _j(node, root), tiers.candidates
    step3 = _manifest(f"{job}/step3_partial")

    def racing(*args: Any, **kwargs: Any) -> Any:  # called right after the scan
        found = real(*args, **kwargs)
        if change == "remove":
            shutil.rmtree(f"{job}/step3_partial")
        else:  # another save's manifest (other files) now commits step3
            _retag(f"{job}/step2_partial/{MANIFEST}", f"{job}/step3_partial/{MANIFEST}", "step3")
        return found

    monkeypatch.setattr(tiers, "candidates", racing)
    rc, out, err = _run("ls", root, "--local", node, "--json")
    assert rc == 0, err
    rows = json.loads(out)["fast"]["checkpoints"]
    assert [(r["tag"], r["save_id"], r["resume"]) for r in rows][0] == ("step3", step3.save_id, True)
    assert [r["tag"] for r in rows] == ["step3", "step2"]


def test_warnings_name_a_relative_local_folder_as_given(
    tiered: tuple[str, str], tmp_path: Any, monkeypatch: Any
) -> None:
    root, node = tiered
    _flip_byte(f"{_j(node, root)}/step3_partial/{MANIFEST}")
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _run("ls", root, "--local", "node0")
    assert rc == 0
    rel = os.path.relpath(f"{_j(node, root)}/step3_partial/{MANIFEST}", tmp_path)
    assert rel.startswith("node0/smpckpt-job-")
    assert f"warning: {rel} is " in out, out
