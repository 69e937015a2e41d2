"""Every ```python block of README.md runs as printed.

The code is read from README.md at test time (never copied here), so an edit that breaks an example
fails this file. The only adaptations: names an example leaves to the reader (``model``, ``opt``,
``layout``, ...) are defined in the namespace the block is ``exec``-ed in, and the example's paths
(``"/fsx/run1"``, ``"ckpt/step100"``) become paths under a pytest tmp dir by plain string replacement.
Blocks are found by order and each is identified by a line it must contain; a README with more or fewer
python blocks fails :func:`test_every_python_block_is_handled` until a test here handles the new one.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import readme_workers as rw
import torch
from dist_harness import run_world
from torch import nn

README = Path(__file__).resolve().parent.parent / "README.md"

#: each python block of README.md, in order: a line that identifies it
MARKERS = (
    "ParallelSavePlanner(layout, specs)",
    "dist.destroy_process_group()",
    "print(restarted.last_resume_info.path_taken)",
    'local_path="/dev/shm/ckpt",',
    "translate_function=smpckpt.hf.llama.TRANSLATION,",
)
#: block 1: where the example moves to the 4-rank world, and its save statement
LATER_ON_4_RANKS = "# ... later, on 4 ranks with TP=4 and no PP:"
SAVE_LINE = "dcp.save("

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Snippet:
    """README text and the README line its first line is on (so tracebacks can name README lines)."""

    text: str
    first_line: int

    def replaced(self, old: str, new: str) -> Snippet:
        """The example's path ``old`` (which must occur) replaced by ``new``; line count unchanged."""
        assert old in self.text, f"README example (line {self.first_line}) no longer contains {old!r}"
        assert "\n" not in new
        return Snippet(self.text.replace(old, new), self.first_line)

    def arg(self) -> tuple[str, int]:
        """What ``readme_workers.run_snippet`` takes (picklable, for the ranks)."""
        return self.text, self.first_line


def plain_path(path: Path) -> str:
    """``path`` as text that can stand inside the example's string literals (no quotes, backslashes)."""
    text = str(path)
    assert not set(text) & set("\n\"'\\"), f"{text!r} cannot replace a path inside a string literal"
    return text


def python_blocks(readme: Path | None = None) -> list[Snippet]:
    """Every ```python block of ``readme`` (default: :data:`README`, looked up now), in order, read now."""
    text = (readme or README).read_text(encoding="utf-8")
    return [Snippet(m.group(1), text.count("\n", 0, m.start(1)) + 1) for m in _FENCE.finditer(text)]


def block(index: int, readme: Path | None = None) -> Snippet:
    """Block ``index`` (0-based), after checking it is the one :data:`MARKERS` says."""
    blocks = python_blocks(readme)
    assert len(blocks) == len(MARKERS), f"README.md has {len(blocks)} python blocks; this test handles {len(MARKERS)}"
    found = blocks[index]
    assert MARKERS[index] in found.text, f"python block {index + 1} of README.md lacks {MARKERS[index]!r}"
    return found


def split_lines(snippet: Snippet, predicate_line: str, *, starts: bool) -> tuple[Snippet, Snippet]:
    """``snippet`` cut before the one line that starts with (``starts``) or equals ``predicate_line``;
    with ``starts=False`` the matching line (a comment) is dropped from the second part."""
    lines = snippet.text.splitlines(keepends=True)
    hits = [
        i
        for i, line in enumerate(lines)
        if (line.startswith(predicate_line) if starts else line.strip() == predicate_line)
    ]
    assert len(hits) == 1, f"README block at line {snippet.first_line}: expected one line {predicate_line!r}"
    cut = hits[0]
    rest = cut if starts else cut + 1
    return Snippet("".join(lines[:cut]), snippet.first_line), Snippet("".join(lines[rest:]), snippet.first_line + rest)


def ten_lines_parts(ckpt: str, readme: Path | None = None) -> tuple[Snippet, Snippet, Snippet]:
    """Block 1 as set-up (imports, layout, specs, state), the save, and the load on 4 ranks."""
    example = block(0, readme).replaced('"ckpt/step100"', f'"{ckpt}"')
    before, load = split_lines(example, LATER_ON_4_RANKS, starts=False)
    setup, save = split_lines(before, SAVE_LINE, starts=True)
    return setup, save, load


def test_every_python_block_is_handled() -> None:
    blocks = python_blocks()
    assert len(blocks) == len(MARKERS), (
        f"README.md has {len(blocks)} python blocks but this test handles {len(MARKERS)}: "
        "add a test for the new block (and its marker line)"
    )
    for i, marker in enumerate(MARKERS):
        assert marker in blocks[i].text, f"python block {i + 1} of README.md lacks {marker!r}"


@pytest.mark.dist
def test_ten_lines_save_on_8_ranks_load_on_4(tmp_path: Path) -> None:
    """Block 1: dcp.save on tp=2 x pp=2 x dp=2, dcp.load on tp=4; parameters and Adam's exp_avg
    (fused QKV included) equal the TP=4 slices of what was saved, bit-exact."""
    ckpt = plain_path(tmp_path / "ckpt" / "step100")
    setup, save, load = ten_lines_parts(ckpt)
    saved = run_world(rw.ten_lines_save, 8, str(README), setup.arg(), save.arg(), timeout=180)
    assert saved == [True] * 8, "the example's layout is not the one the test cut its model for"
    assert os.path.exists(os.path.join(ckpt, ".metadata"))
    loaded = run_world(rw.ten_lines_load, 4, str(README), setup.arg(), load.arg(), timeout=120)
    for rank, got in enumerate(loaded):
        assert got["wrong"] == [], f"rank {rank}: loaded values differ from the TP=4 slices: {got['wrong']}"
        assert got["steps_one"], f"rank {rank}: optimizer step counters not loaded"


@pytest.mark.dist
def test_end_of_rank_recipe_after_async_save(tmp_path: Path) -> None:
    """Block 2 on 2 ranks after an async save: the save committed and the process group is gone."""
    recipe = block(1)
    results = run_world(rw.end_of_rank, 2, str(README), recipe.arg(), str(tmp_path), timeout=120)
    assert results == [{"future_done": True, "committed": True, "group_gone": True}] * 2


def test_checkpointer_example_in_one_process(tmp_path: Path) -> None:
    """Block 3 in this process (no process group): a Checkpointer saves (async) and waits; another one
    resumes the newest tag, printing "fast"."""
    import smpckpt
    from smpckpt import ParallelLayout

    root = plain_path(tmp_path / "run1")
    example = block(2).replaced("/fsx/run1", root)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = rw.adam_step(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    ns: dict[str, Any] = {"model": model, "opt": opt, "step": 3, "layout": ParallelLayout(), "specs": {}}
    ns.update(new_layout=ns["layout"], new_specs=ns["specs"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rw.run_snippet(*example.arg(), str(README), ns)
    assert out.getvalue().split() == ["fast"]
    assert ns["user_content"] == {"step": 3}
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(opt.state[p]["exp_avg"], e) for p, e in zip(model.parameters(), exp_avg))
    # what the example saved (it resumed into the very model it saved): into a fresh, zeroed model
    fresh = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    assert smpckpt.resume_from_checkpoint(root, "step3", model=fresh) == {"step": 3}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())


@pytest.mark.dist
def test_tiered_checkpoints_on_two_nodes(tmp_path: Path) -> None:
    """Block 4 on 4 ranks as 2 nodes x 2 (``LOCAL_WORLD_SIZE=2``): the durable root a tmp folder (the
    example's S3 URL replaced, its storage options ``None``), each node's fast tier its own folder. The
    save commits to both fast tiers (each with every rank's files: 2 nodes, 2 replicas) and the resume
    prints "fast", restoring what was saved."""
    durable = plain_path(tmp_path / "durable")
    example = block(3).replaced("s3://bucket/run", durable)
    results = run_world(rw.tiered_example, 4, str(README), example.arg(), str(tmp_path), timeout=180)
    for rank, got in enumerate(results):
        assert got == {"printed": ["fast"], "same": True, "node_committed": True}, (rank, got)
    assert not (tmp_path / "durable" / "step1_partial").exists()  # save 1 of durable_every=3: fast tier only


@pytest.mark.dist
def test_full_checkpoint_and_hugging_face(tmp_path: Path) -> None:
    """Block 5 on 2 ranks (tp=2, tiny Llama): a bf16 HF artifact whose from_pretrained weights are the
    original's cast to bf16, and a resume from a save_pretrained folder that gives each rank its slices."""
    rw.hf_helpers_importable()
    from hf_reference import tiny_model

    root = plain_path(tmp_path / "run1")
    hf_folder = str(tmp_path / "pretrained")
    tiny_model("llama", seed=rw.LLAMA_SEED, dtype=torch.float32).save_pretrained(hf_folder)
    example = block(4).replaced("/fsx/run1", root)  # also inside "/fsx/run1/final"
    results = run_world(rw.hf_example, 2, str(README), example.arg(), root, hf_folder, timeout=180)
    for rank, got in enumerate(results):
        assert got["pieces_differ"] == [], f"rank {rank}: pieces differ after resuming from the HF folder"
    got = results[0]
    assert got["artifact_dtypes"] == ["torch.bfloat16"]
    assert got["artifact_keys_differ"] == []
    assert got["artifact_values_differ"] == []
    assert got["user_content"] == {"step": 5}
    config = json.loads((tmp_path / "run1" / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_a_broken_example_fails(tmp_path: Path) -> None:
    """The examples are read from the README at test time: a scratch README whose Checkpointer example
    calls a method that does not exist fails the block-3 run."""
    broken = tmp_path / "README.md"
    broken.write_text(
        README.read_text(encoding="utf-8").replace("ckpt.save(", "ckpt.save_checkpnt("),
        encoding="utf-8",
    )
    example = block(2, broken).replaced("/fsx/run1", plain_path(tmp_path / "run1"))
    model = nn.Linear(2, 2)
    ns: dict[str, Any] = {"model": model, "opt": rw.adam_step(model), "step": 3, "layout": None, "specs": None}
    ns.update(new_layout=None, new_specs=None)
    with pytest.raises(AttributeError, match="save_checkpnt"):
        rw.run_snippet(*example.arg(), str(broken), ns)
