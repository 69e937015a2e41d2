"""Views of one memory that are no tie: a conjugate or negated view shares its base's address, dtype, shape
and strides yet shows other values, so each is saved and loaded under its own key (partial, async, full and
translate_function resumes alike); an old checkpoint that recorded one as a tie resumes as it did."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch
from sim import sim_load, sim_save
from torch import nn

import smpckpt
from smpckpt import ParallelLayout
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

# fix69d F4: a conjugate or negated view shares its memory's address, dtype, shape and strides, yet shows other
# values: taken as a tie, the save wrote the plain view once and loaded it under both keys (conjugate lost)
_C = torch.tensor([1 + 2j, 3 - 4j, -5j], dtype=torch.complex64)


_VIEWS = {
    "conjugate": lambda c: {"a": c, "b": c.conj()},
    "negated": lambda c: {"a": c.imag, "b": c.conj().imag},
    "negated conjugate": lambda c: {"a": c.conj(), "b": c.conj().imag, "c": c.imag},
}


@pytest.mark.parametrize("case", sorted(_VIEWS))
def test_a_conjugate_or_negated_view_is_saved_with_its_own_values(tmp_path: Path, case: str) -> None:
    state = _VIEWS[case](_C.clone())
    planner = ParallelSavePlanner(ParallelLayout(), rank=0)
    sim_save([state], [planner], [FsspecStorageWriter(str(tmp_path))])
    assert planner.tied == {}
    dest = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
    sim_load([dest], [ParallelLoadPlanner(ParallelLayout(), rank=0)], [FsspecStorageReader(str(tmp_path))])
    for key, value in state.items():
        assert torch.equal(dest[key], value.resolve_conj().resolve_neg()), key


class _Conj(nn.Module):
    """A complex parameter, a buffer that is its conjugate view and one that is its imaginary part negated."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(_C.clone())
        self.register_buffer("wc", self.w.detach().conj())
        self.register_buffer("neg_imag", self.w.detach().conj().imag)


@pytest.mark.parametrize("how", ["sync", "async", "async overlap_staging"])
def test_a_conjugate_view_buffer_resumes_with_its_own_values(tmp_path: Path, how: str) -> None:
    src = _Conj()
    if how == "sync":
        smpckpt.save_checkpoint(str(tmp_path), "t", model=src, options=smpckpt.SaveOptions(save_rng=False))
    else:
        opts = smpckpt.AsyncOptions(enabled=True, overlap_staging=how.endswith("staging"))
        with smpckpt.Checkpointer(str(tmp_path), async_options=opts) as ckpt:
            ckpt.save("t", src).result()
    with open(tmp_path / "t_partial" / "smpckpt.manifest.json") as f:
        assert not json.load(f)["extra"]["layout_record"].get("tied")
    dst = _Conj()
    with torch.no_grad():
        dst.w.zero_()
    dst.wc, dst.neg_imag = torch.zeros(3, dtype=torch.complex64), torch.zeros(3)  # buffers of their own
    smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dst)
    assert torch.equal(dst.w, _C) and torch.equal(dst.wc, _C.conj()) and torch.equal(dst.neg_imag, -_C.imag)


def test_a_full_artifact_holds_a_conjugate_view_under_its_own_key(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from smpckpt.storage import FullArtifactWriter, FullOptions

    c = _C.clone()
    writer = FullArtifactWriter(str(tmp_path / "f"), full=FullOptions(format="torch_save"))
    dcp.save({"a": c, "b": c.conj()}, storage_writer=writer, planner=ParallelSavePlanner(ParallelLayout()))
    stored: dict[str, torch.Tensor] = {}
    for f in glob.glob(str(tmp_path / "f" / "*.bin")):
        stored.update(torch.load(f, weights_only=True))
    assert sorted(stored) == ["a", "b"]
    assert torch.equal(stored["a"], _C) and torch.equal(stored["b"], _C.conj())


def test_a_translate_function_resume_gives_views_of_one_memory_their_own_destinations(tmp_path: Path) -> None:
    """Loaded aside (a translate_function), keys over one memory seen the same way share one destination; a
    conjugate or negated view, or one as another dtype, gets its own (the dtype view was refused as a dtype
    mismatch, the conjugate pair as a tie whose saved values differ)."""
    models = _Conj(), _Conj()
    for model in models:
        model.register_buffer("f", torch.tensor([1.5, -2.0, 3.0]))
        model.register_buffer("bits", model.f.view(torch.int32))
    src, dst = models
    smpckpt.save_checkpoint(str(tmp_path), "t", model=src, options=smpckpt.SaveOptions(save_rng=False))
    with torch.no_grad():
        dst.w.zero_(), dst.f.zero_()
    smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dst, translate_function=lambda sd: sd)
    assert torch.equal(dst.w, _C) and torch.equal(dst.wc, _C.conj()) and torch.equal(dst.neg_imag, -_C.imag)
    assert torch.equal(dst.bits, src.bits) and torch.equal(dst.f, src.f)


def test_an_hf_head_that_is_a_conjugate_view_of_its_embedding_is_not_tied() -> None:
    from smpckpt.hf._common import _tied

    embed = _C.clone().reshape(3, 1)
    assert _tied(embed, embed) and not _tied(embed.conj(), embed) and not _tied(embed.imag, embed.conj().imag)


def test_an_old_checkpoint_tying_a_conjugate_view_to_its_base_resumes_as_it_did(tmp_path: Path) -> None:
    """rev69f F1: tests/data/conj_v0 (smpckpt 55b1992 recorded ``wc = w.conj()`` as a tie of ``w``, storing ``w``)
    resumed into the same model was refused once conjugate views were told apart (memory holding two values):
    ``w`` alone loads, ``wc`` shows it through its view as when it was saved, and a warning names both."""
    import shutil

    shutil.copytree(Path(__file__).parent / "data" / "conj_v0", tmp_path / "c")
    dst = nn.Module()
    dst.w = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    dst.register_buffer("wc", dst.w.detach().conj())
    with pytest.warns(UserWarning, match=r"model\.wc: the checkpoint records it as a tie of model\.w .*conjugate"):
        smpckpt.resume_from_checkpoint(str(tmp_path / "c"), "t", model=dst)
    saved = torch.tensor([1 + 2j, -3 + 0.5j, 4 - 1j])  # make_quantized_conj_v0.py's Conj.w
    assert torch.equal(dst.w.detach(), saved) and torch.equal(dst.wc.resolve_conj(), saved.conj())
