"""Destinations that share memory without being one view (``base[0:4]`` and ``base[2:6]`` under two keys,
or one memory seen in another dtype): written one after the other, the last would silently win where
they overlap. They are read into scratch and checked once all are in: values that disagree there are
refused naming the keys, values that agree (saved from a model whose views share that memory) load
bit-exact. Tied keys (the same view) are tests/test_tied.py's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from sim import sim_load, sim_save
from torch import nn

import smpckpt
from smpckpt import ParallelLayout
from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter

View = Callable[[torch.Tensor], dict[str, torch.Tensor]]


def _save(path: Path, state: dict[str, torch.Tensor]) -> None:
    sim_save([state], [ParallelSavePlanner(ParallelLayout(), rank=0)], [FsspecStorageWriter(str(path))])


def _load(path: Path, state: dict[str, torch.Tensor], **kw: bool) -> ParallelLoadPlanner:
    planner = ParallelLoadPlanner(ParallelLayout(), rank=0, **kw)
    sim_load([state], [planner], [FsspecStorageReader(str(path))])
    return planner


# the hunt's repro (partial overlap), and one memory viewed another way: the same bytes as int32
_CASES: dict[str, tuple[dict[str, torch.Tensor], View]] = {
    "partial overlap": (
        {"a": torch.tensor([0.0, 1, 2, 3]), "b": torch.tensor([10.0, 11, 12, 13])},
        lambda base: {"a": base[0:4], "b": base[2:6]},
    ),
    "same memory other dtype": (
        {"a": torch.tensor([0.0, 1, 2, 3]), "b": torch.tensor([5, 6, 7, 8], dtype=torch.int32)},
        lambda base: {"a": base[0:4], "b": base[0:4].view(torch.int32)},
    ),
    "same memory other strides": (
        {"a": torch.tensor([0.0, 1, 2, 3]), "b": torch.tensor([10.0, 11, 12, 13])},
        lambda base: {"a": base[0:4], "b": base.as_strided((4,), (2,), 0)},
    ),
    # fix69d F4: a conjugate or negated view of one memory shows other values (it was taken as a tie of the
    # plain view: a consistent checkpoint refused, an inconsistent one loaded silently)
    "conjugate view": (
        {"a": torch.tensor([1 + 2j, 3 - 4j, 5j, -6]), "b": torch.tensor([1 + 2j, 3 - 4j, 5j, -6])},
        lambda base: {"a": base.view(torch.complex64), "b": base.view(torch.complex64).conj()},
    ),
    "negated view": (
        {"a": torch.tensor([1.0, -2, 3, 4]), "b": torch.tensor([1.0, -2, 3, 4])},
        lambda base: {"a": base.view(torch.complex64).imag, "b": base.view(torch.complex64).conj().imag},
    ),
    # (F5: comparing the bits of a negated view raised torch's "view is not supported ... negative bit")
    "negated view overlapping": (
        {"a": torch.tensor([1.0, -2, 3, 4]), "b": torch.tensor([1.0, -2])},
        lambda base: {"a": base.view(torch.complex64).imag, "b": base.view(torch.complex64).conj().imag[1:3]},
    ),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_disagreeing_values_for_shared_memory_are_refused_by_name(tmp_path: Path, case: str) -> None:
    saved, views = _CASES[case]
    _save(tmp_path / "c", saved)
    with pytest.raises(smpckpt.LayoutMismatch, match=r"'a', 'b' are destinations that share memory"):
        _load(tmp_path / "c", views(torch.zeros(8)))


@pytest.mark.parametrize("case", sorted(_CASES))
def test_agreeing_values_for_shared_memory_load_bit_exact(tmp_path: Path, case: str) -> None:
    _, views = _CASES[case]
    base = torch.arange(8, dtype=torch.float32) * 1.5 - 2.0
    _save(tmp_path / "c", {k: v.clone() for k, v in views(base).items()})  # saved from a model sharing it
    dst = torch.full((8,), float("nan"))
    planner = _load(tmp_path / "c", views(dst))
    shared = views(base)
    for key, value in views(dst).items():
        assert torch.equal(value, shared[key]), key
    assert planner.report is not None and planner.report.tied == {}


def test_a_key_left_out_keeps_its_value_or_the_load_is_refused(tmp_path: Path) -> None:
    """allow_partial_load keeps a missing key's value: a loaded key overwriting it there is refused."""
    _save(tmp_path / "c", {"a": torch.tensor([0.0, 1, 2, 3])})
    base = torch.zeros(6)
    with pytest.raises(smpckpt.LayoutMismatch, match=r"'b' would not hold its saved value \('b': not in the"):
        _load(tmp_path / "c", {"a": base[0:4], "b": base[2:6]}, allow_partial_load=True)
    # a missing key whose kept value agrees where they overlap is no error
    base = torch.tensor([0.0, 1, 2, 3, 7, 8])
    _load(tmp_path / "c", {"a": base[0:4], "b": base[2:6]}, allow_partial_load=True)
    assert torch.equal(base, torch.tensor([0.0, 1, 2, 3, 7, 8]))


class _ViewsItsWeight(nn.Module):
    """A buffer viewing part of a parameter's memory (both in the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6))
        self.register_buffer("cols", self.weight.detach()[:, 2:5])


def test_a_model_whose_buffer_views_its_weight_resumes_bit_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src, dst = _ViewsItsWeight(), _ViewsItsWeight()
    smpckpt.save_checkpoint(str(tmp_path), "t", model=src, options=smpckpt.SaveOptions(save_rng=False))
    smpckpt.resume_from_checkpoint(str(tmp_path), "t", model=dst)
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.cols, src.cols)
    assert dst.cols.data_ptr() == dst.weight.data_ptr() + 2 * 4  # still a view of the weight


def test_a_view_the_loaded_keys_cover_whole_follows_them_without_a_saved_value(tmp_path: Path) -> None:
    """A buffer viewing part of a weight, resumed with allow_partial_load from a checkpoint saved before
    the buffer existed: the buffer has no saved value and follows the weight it views (it was refused as
    'would not hold its saved value'); one the loaded keys cover only in part is still refused above."""
    torch.manual_seed(0)
    weight = torch.randn(4, 6)
    _save(tmp_path / "c", {"weight": weight})
    base = torch.zeros(4, 6)
    _load(tmp_path / "c", {"weight": base, "cols": base[:, 2:5]}, allow_partial_load=True)
    assert torch.equal(base, weight)


def test_a_load_without_shared_memory_reads_straight_into_its_destinations(tmp_path: Path) -> None:
    """No overlap, no scratch: every read lands in the state dict's own tensor; disjoint views of one
    storage (rows of one matrix) are no overlap either."""
    base = torch.randn(4, 3)
    saved = {"a": torch.randn(5), "b": base[0:2].clone(), "c": base[2:4].clone()}
    _save(tmp_path / "c", saved)
    dst_base = torch.zeros(4, 3)
    state = {"a": torch.zeros(5), "b": dst_base[0:2], "c": dst_base[2:4]}
    planner = _load(tmp_path / "c", state)
    assert planner._shared.dest == {}
    assert all(planner.entries[k].value is state[k] for k in state)
    assert all(torch.equal(state[k], saved[k]) for k in state)


def test_an_expanded_destination_is_refused_naming_the_key_unless_nothing_is_read_into_it(tmp_path: Path) -> None:
    """Several elements of an expanded view are one memory location: torch refused the copy, naming no key
    (hunt69a F5). A key the checkpoint lacks (allow_partial_load) is not read: its expanded destination stays."""
    _save(tmp_path / "c", {"a": torch.arange(8.0).view(2, 4)})
    with pytest.raises(smpckpt.SpecError, match=r"a: the destination \(shape \(2, 4\), strides \(0, 1\)\) is an expan"):
        _load(tmp_path / "c", {"a": torch.zeros(4)[None].expand(2, 4)})
    kept = torch.ones(1).expand(3)
    _load(tmp_path / "c", {"a": torch.zeros(2, 4), "b": kept}, allow_partial_load=True)
    assert torch.equal(kept, torch.ones(3))


def test_an_expanded_destination_without_elements_loads(tmp_path: Path) -> None:
    """rev69f F4: ``torch.zeros(0, 1).expand(0, 5)`` has no two elements at one location (it has none): it
    resumed before the expanded-view check, then was refused."""
    _save(tmp_path / "c", {"e": torch.zeros(0, 5), "a": torch.arange(3.0)})
    state = {"e": torch.zeros(0, 1).expand(0, 5), "a": torch.zeros(3)}
    _load(tmp_path / "c", state)
    assert torch.equal(state["a"], torch.arange(3.0)) and state["e"].shape == (0, 5)
