"""CLI edges found by an audit: convert never writes into a folder named as its output and reports
failures in one line; a failed consolidation leaves nothing in its output; consolidate refuses an
optimizer artifact the checkpoint cannot give; inspect shows a full checkpoint's user content."""

from __future__ import annotations

import io
import os
from typing import Any

import pytest
import torch
from damage import flip_byte
from torch import nn

from smpckpt import consolidate_checkpoint, save_checkpoint
from smpckpt.tools.cli import main
from smpckpt.tools.convert import convert_checkpoint


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(list(argv), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _saved(root: str, **kw: Any) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 2))
    save_checkpoint(root, "s", model=m, **kw)
    return m


def test_convert_refuses_a_folder_as_its_output_file(tmp_path: Any) -> None:
    root = str(tmp_path)
    _saved(root)
    out = os.path.join(root, "export")
    os.makedirs(out)
    for target in (out, os.path.join(root, "s_partial")):  # an empty folder; the source checkpoint itself
        before = sorted(os.listdir(target))
        rc, _, err = _run("convert", os.path.join(root, "s"), target, "--overwrite")
        assert rc == 1 and err.startswith(f"smpckpt convert: IsADirectoryError: {target} is a folder"), err
        assert sorted(os.listdir(target)) == before


def test_convert_failures_are_one_line(tmp_path: Any) -> None:
    root = str(tmp_path)
    _saved(root)
    save_checkpoint(root, "t", model=nn.Linear(2, 2))
    rc, _, err = _run("convert", os.path.join(root, "t"), os.path.join(root, "s_partial"), "--to", "dcp")
    assert rc == 1 and err.count("\n") == 1 and err.startswith("smpckpt convert: CheckpointExists: "), err
    data = sorted(f for f in os.listdir(os.path.join(root, "s_partial")) if f.endswith(".distcp"))
    flip_byte(os.path.join(root, "s_partial", data[0]), 100)
    rc, _, err = _run("convert", os.path.join(root, "s"), os.path.join(root, "s.pt"))
    assert rc == 1 and err.count("\n") == 1 and err.startswith("smpckpt convert: CheckpointCorrupt: "), err
    assert data[0] in err and not os.path.exists(os.path.join(root, "s.pt"))


def test_a_failed_consolidation_leaves_nothing_in_its_output(tmp_path: Any) -> None:
    root = str(tmp_path)
    _saved(root)
    for name in os.listdir(os.path.join(root, "s_partial")):  # whichever file holds the model's bytes
        if name.endswith(".distcp"):
            flip_byte(os.path.join(root, "s_partial", name), 100)
    out = os.path.join(root, "full")
    rc, _, err = _run("consolidate", os.path.join(root, "s"), out, "--no-progress")
    assert rc == 1 and "CheckpointCorrupt" in err, err
    assert not os.path.exists(out) or os.listdir(out) == []


def test_consolidate_include_optimizer_needs_an_optimizer_saved(tmp_path: Any) -> None:
    """A checkpoint saved without optimizer has nothing to export for it (one saved with an optimizer that
    had no state yet exports: tests/api/test_optimizer_state.py's fresh-optimizer test)."""
    root = str(tmp_path)
    _saved(root)
    out = os.path.join(root, "full")
    rc, _, err = _run("consolidate", os.path.join(root, "s"), out, "--include-optimizer", "--no-progress")
    assert rc == 1 and "the checkpoint was saved without optimizer" in err, err
    assert not os.path.exists(out)


def test_inspect_shows_a_full_checkpoints_user_content(tmp_path: Any) -> None:
    root = str(tmp_path)
    _saved(root, partial=False, user_content={"epoch": 3, "lr": 0.1})
    rc, out, _ = _run("inspect", os.path.join(root, "s"))
    assert rc == 0 and "user content: epoch, lr\n" in out, out


def test_verify_fails_a_manifest_whose_digest_field_name_is_damaged(tmp_path: Any) -> None:
    """One flipped bit in the name of the manifest's own checksum field made it read as a manifest from
    before that field (which loads unchecked): the rest of it could then be edited and still verify."""
    root = str(tmp_path)
    _saved(root)
    path = os.path.join(root, "s_partial", "smpckpt.manifest.json")
    text = open(path).read()
    assert '"manifest_xxh3_64"' in text
    with open(path, "w") as f:
        f.write(text.replace('"manifest_xxh3_64"', '"m`nifest_xxh3_64"').replace('"tag": "s"', '"tag": "x"'))
    rc, out, err = _run("verify", os.path.join(root, "s"))
    assert rc == 1 and "unknown field(s) ['m`nifest_xxh3_64']" in out + err, (out, err)


def test_ls_refuses_a_file_or_a_checkpoint_instead_of_a_root(tmp_path: Any) -> None:
    """`smpckpt ls ROOT/newest` printed "no partial checkpoints" and exited 0; a checkpoint folder too."""
    save_checkpoint(str(tmp_path), "s1", model=nn.Linear(2, 2), save_rng=False)
    for given, says in [
        ("newest", "is the file naming the root's newest checkpoint, not a checkpoint root"),
        ("s1_partial", "is a checkpoint, not a root of checkpoints"),
        ("s1", "is a checkpoint, not a root of checkpoints"),
    ]:
        out, err = io.StringIO(), io.StringIO()
        assert main(["ls", str(tmp_path / given)], stdout=out, stderr=err) == 2, (given, out.getvalue())
        assert says in err.getvalue() and f"`smpckpt ls {tmp_path}`" in err.getvalue(), err.getvalue()
    out = io.StringIO()
    assert main(["ls", str(tmp_path)], stdout=out, stderr=io.StringIO()) == 0
    assert "s1" in out.getvalue() and "committed" in out.getvalue()


def test_a_tag_naming_a_partial_and_a_full_checkpoint_is_refused_not_resolved_to_the_partial(tmp_path: Any) -> None:
    """smp's layout keeps a tag's partial (``{tag}_partial``) and full (``{tag}``) checkpoints side by side, and the
    two can hold different weights (a deliverable exported with EMA weights, or at a later step). ``PATH/TAG`` was
    resolved to the partial one even where the folder named exists and is committed, so ``convert`` and
    ``consolidate`` wrote the other checkpoint's weights without a word (hunt71d). Now it is refused naming both;
    ``PATH/TAG_partial`` names the partial one and ``PATH/TAG/`` (as a shell completes the folder) the full one."""
    root = str(tmp_path / "root")
    m = _saved(root)  # s_partial
    saved = m[0].weight.detach().clone()
    with torch.no_grad():
        m[0].weight.mul_(3)
    save_checkpoint(root, "s", partial=False, model=m)  # the full one: other weights
    full = m[0].weight.detach().clone()
    spec = os.path.join(root, "s")
    for call in (convert_checkpoint, consolidate_checkpoint):
        with pytest.raises(ValueError, match=r"names two checkpoints: .*s_partial \(partial\) and .*s \(full\)"):
            call(spec, str(tmp_path / call.__name__))
        assert not os.path.exists(tmp_path / call.__name__)
    for command in ("convert", "consolidate", "inspect", "verify"):
        rc, _, err = _run(command, spec, *((str(tmp_path / command),) if command in ("convert", "consolidate") else ()))
        assert rc == 2 and "names two checkpoints" in err and f"{spec}_partial" in err and f"{spec}/" in err, err
        assert "(as a str ending in '/')" in err, err  # a pathlib.Path drops the slash (rev71d L3)
    for name, want in ((f"{spec}_partial", saved), (f"{spec}/", full)):
        out = str(tmp_path / f"{len(name)}.pt")
        convert_checkpoint(name, out)
        assert torch.equal(torch.load(out)["model"]["0.weight"], want), name
    rc, out, _ = _run("inspect", f"{spec}/")
    assert rc == 0 and out.startswith(f"checkpoint: {spec} (committed)"), out
    save_checkpoint(root, "p", model=m)  # a partial one alone: PATH/TAG (with or without the slash) names it, as before
    rc, out, _ = _run("inspect", os.path.join(root, "p/"))
    assert rc == 0 and out.startswith(f"checkpoint: {os.path.join(root, 'p_partial')} (committed)"), out
    # beside a full folder not committed (a save that did not finish, a plain HF folder) PATH/TAG is the partial
    # one (rev71d L1: refused as two checkpoints); PATH/TAG/ still names that folder
    hf = os.path.join(root, "p")
    os.makedirs(hf)
    with open(os.path.join(hf, "config.json"), "w") as f:
        f.write("{}")
    for command in ("inspect", "verify"):
        rc, out, err = _run(command, hf)
        assert rc == 0 and f"{hf}_partial" in out and "names two" not in err, (command, out, err)
    converted = str(tmp_path / "p.pt")
    convert_checkpoint(hf, converted)
    assert torch.equal(torch.load(converted)["model"]["0.weight"], full)
    assert _run("inspect", f"{hf}/")[0] != 0  # the folder named: not a checkpoint (uncommitted)
