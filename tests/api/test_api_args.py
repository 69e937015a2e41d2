"""Arguments refused by name, up front, before anything is written: booleans are booleans (a truthy
string is not yes), counts are counts, and options that do not apply to the mode asked for are errors,
not silently ignored."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from smpckpt import resume_from_checkpoint, save_checkpoint
from smpckpt.storage import FsspecStorageReader, FsspecStorageWriter


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


@pytest.mark.parametrize(
    "name", ["overwrite", "save_rng", "sync_files", "async_save", "wait_for_previous", "freeze_gc", "verify_replicas"]
)
def test_save_flags_must_be_booleans(tmp_path: Any, name: str) -> None:
    with pytest.raises(TypeError, match=f"{name} must be True or False, got 'no'"):
        save_checkpoint(str(tmp_path), "t", model=_model(), **{name: "no"})
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    "name", ["missing_ok", "strict", "load_rng", "allow_pickle", "allow_dtype_cast", "verify_checksums", "freeze_gc"]
)
def test_resume_flags_must_be_booleans(tmp_path: Any, name: str) -> None:
    save_checkpoint(str(tmp_path), "t", model=_model())
    with pytest.raises(TypeError, match=f"{name} must be True or False, got 1"):
        resume_from_checkpoint(str(tmp_path), model=_model(), **{name: 1})


@pytest.mark.parametrize(
    "option",
    [
        {"dtype": torch.bfloat16},
        {"include_optimizer": True},
        {"hf_config": {"model_type": "gpt2"}},
        {"max_shard_size": "1GB"},
    ],
)
def test_full_only_options_are_refused_on_partial_saves(tmp_path: Any, option: dict[str, Any]) -> None:
    (name,) = option
    with pytest.raises(ValueError, match=f"{name} apply to full checkpoints only"):
        save_checkpoint(str(tmp_path), "t", model=_model(), **option)
    assert not os.listdir(tmp_path)


def test_full_saves_refuse_integer_dtypes_and_bad_counts(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
        save_checkpoint(str(tmp_path), "f", partial=False, model=_model(), dtype=torch.int8)
    with pytest.raises(ValueError, match="num_kept_partial_checkpoints must be >= 1"):
        save_checkpoint(str(tmp_path), "f", partial=False, model=_model(), num_kept_partial_checkpoints=-1)
    assert not os.listdir(tmp_path)
    # smp accepts the retention count with full saves: so do we (it changes nothing there)
    save_checkpoint(str(tmp_path), "f", partial=False, model=_model(), num_kept_partial_checkpoints=2)


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"thread_count": -1}, "thread_count must be >= 1"),
        ({"thread_count": 2.5}, "thread_count must be an int or None"),
        ({"block_size": 0}, "block_size must be >= 4096"),
        ({"part_size": 1 << 10}, "part_size must be >= 5242880"),
        ({"max_parts_in_flight": 0}, "max_parts_in_flight must be >= 1"),
        ({"overwrite": "yes"}, "overwrite must be True or False"),
    ],
)
def test_storage_writer_options(tmp_path: Any, kw: dict[str, Any], error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        FsspecStorageWriter(str(tmp_path), **kw)


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"coalesce_gap": -1}, "coalesce_gap must be >= 0"),
        ({"thread_count": 0}, "thread_count must be >= 1"),
        ({"reads_in_flight": 0}, "reads_in_flight must be >= 1"),
        ({"verify_checksums": "false"}, "verify_checksums must be True or False"),
    ],
)
def test_storage_reader_options(tmp_path: Any, kw: dict[str, Any], error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        FsspecStorageReader(str(tmp_path), **kw)


@pytest.mark.parametrize("folder", ["s_partial", "s"])
def test_resume_loads_a_folder_stock_dcp_save_wrote(tmp_path: Any, folder: str, caplog: Any) -> None:
    """Our reader reads stock DCP folders; resume takes them under the tag (``{tag}_partial`` or ``{tag}``),
    without integrity checks (there is no manifest), and says so."""
    import torch.distributed.checkpoint as dcp

    src = _model()
    dcp.save({"model": src.state_dict()}, checkpoint_id=str(tmp_path / folder))
    dst = nn.Linear(3, 2)
    with caplog.at_level("WARNING", logger="smpckpt.api"):
        assert resume_from_checkpoint(str(tmp_path), "s", model=dst) is None
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))
    assert "written by stock dcp.save" in caplog.text


def test_a_checkpoint_folder_given_as_the_root_is_named_in_the_error(tmp_path: Any) -> None:
    from smpckpt import CheckpointNotFound

    save_checkpoint(str(tmp_path), "t", model=_model())
    with pytest.raises(CheckpointNotFound, match=r"is itself a checkpoint folder: pass its parent as path .*tag='t'"):
        resume_from_checkpoint(str(tmp_path / "t_partial"), model=_model())


def test_an_io_error_outside_dcp_is_a_checkpoint_error_naming_the_object(tmp_path: Any, monkeypatch: Any) -> None:
    """Listing tags or reading newest can fail mid-resume (an S3 endpoint dying): the caller gets our
    CheckpointError naming the object, with the OSError as its cause (issue 33 item 10)."""
    import errno

    import smpckpt.api._resume as resume_steps
    from smpckpt import CheckpointError

    save_checkpoint(str(tmp_path), "t", model=_model())

    def dead(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ECONNRESET, "Connection reset by peer", "bucket/run/t_partial/smpckpt.manifest.json")

    monkeypatch.setattr(resume_steps, "scan_root", dead)
    with pytest.raises(
        CheckpointError, match=r"resuming from .* failed: .*Connection reset.*t_partial/smpckpt\.manifest"
    ) as info:
        resume_from_checkpoint(str(tmp_path), model=_model())
    assert isinstance(info.value.__cause__, OSError)
