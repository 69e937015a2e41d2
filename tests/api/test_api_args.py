"""Arguments refused by name, up front, before anything is written: booleans are booleans (a truthy
string is not yes), counts are counts, and options that do not apply to the mode asked for are errors,
not silently ignored."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest
import torch
from torch import nn

from smpckpt import (
    AsyncOptions,
    ExportOptions,
    FastTier,
    Location,
    ResumeOptions,
    Retention,
    SaveOptions,
    Sharding,
    resume_from_checkpoint,
    save_checkpoint,
)
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


def _translation() -> Any:
    import smpckpt.hf.gpt2

    return smpckpt.hf.gpt2.TRANSLATION


#: (function, partial, option, value): every option that does not apply to the mode asked for
NOT_APPLICABLE = [
    *[
        (save_checkpoint, True, name, value)
        for name, value in [
            ("include_optimizer", True),
            ("dtype", torch.bfloat16),
            ("hf_config", {"model_type": "gpt2"}),
            ("translate_function", "gpt2"),
            ("max_shard_size", "1GB"),
        ]
    ],
    *[
        (save_checkpoint, False, name, value)
        for name, value in [
            ("overwrite", True),
            ("save_rng", False),
            ("remove_uncommitted_older_than", 60.0),
            ("async_save", True),
        ]
    ],
    *[(resume_from_checkpoint, False, name, value) for name, value in [("missing_ok", True), ("load_rng", False)]],
]


@pytest.mark.parametrize(
    ("fn", "partial", "name", "value"), NOT_APPLICABLE, ids=lambda v: getattr(v, "__name__", str(v))
)
def test_options_of_the_other_mode_are_refused_by_name(
    tmp_path: Any, fn: Any, partial: bool, name: str, value: Any
) -> None:
    if name == "translate_function":
        value = _translation()
    if fn is resume_from_checkpoint:
        save_checkpoint(str(tmp_path), "t", partial=partial, model=_model())
    before = sorted(os.listdir(tmp_path))
    mode = "full" if partial else "partial"
    with pytest.raises(ValueError, match=rf"^{name} applies only to {mode} checkpoints \(partial={not partial}\)$"):
        fn(str(tmp_path), "t2" if fn is save_checkpoint else "t", partial=partial, model=_model(), **{name: value})
    assert sorted(os.listdir(tmp_path)) == before  # refused before anything was written
    if fn is resume_from_checkpoint:  # the dataclass refuses it the same way
        with pytest.raises(ValueError, match=rf"^{name} applies only"):
            ResumeOptions(partial=partial, **{name: value})
    else:  # the options of a save's mode have no such field at all
        assert name not in {f.name for f in dataclasses.fields(SaveOptions if partial else ExportOptions)}


def test_several_options_of_the_other_mode_are_named_together(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"^dtype, max_shard_size apply only to full checkpoints \(partial=False\)$"):
        save_checkpoint(str(tmp_path), "t", model=_model(), dtype=torch.bfloat16, max_shard_size="1GB")
    with pytest.raises(ValueError, match=r"^ExportOptions applies only to full checkpoints \(partial=False\)$"):
        save_checkpoint(str(tmp_path), "t", model=_model(), options=ExportOptions(dtype=torch.bfloat16))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    ("cls", "kw", "error", "match"),
    [
        (ResumeOptions, {"partial": "yes"}, TypeError, "partial must be True or False, got 'yes'"),
        (Retention, {"num_kept_partial_checkpoints": 0}, ValueError, "num_kept_partial_checkpoints must be >= 1"),
        (Retention, {"remove_uncommitted_older_than": -1}, ValueError, "remove_uncommitted_older_than must be"),
        (SaveOptions, {"format": "safetensors"}, ValueError, "'safetensors' is a format of full checkpoints"),
        (SaveOptions, {"async_save": 1}, TypeError, "async_save must be True or False, got 1"),
        (ExportOptions, {"format": "zip"}, ValueError, "format must be one of"),
        (ExportOptions, {"dtype": torch.int8}, ValueError, "dtype must be a floating-point"),
        (ExportOptions, {"max_shard_size": "lots"}, ValueError, "size must be bytes or a string"),
        (ExportOptions, {"max_shard_size": 0}, ValueError, "size must be positive"),
        (ExportOptions, {"translate_function": len}, TypeError, "must be a smpckpt.model.translation"),
        (ExportOptions, {"out_storage_options": ["anon"]}, TypeError, "out_storage_options must be a mapping"),
        (Location, {"path": ""}, ValueError, "path must not be empty"),
        (Location, {"path": 3}, TypeError, "path must be a str or os.PathLike, got int"),
        (Location, {"path": "x", "storage_options": "anon"}, TypeError, "storage_options must be a mapping"),
        (Sharding, {"layout": (2, 1, 1)}, TypeError, "layout must be a ParallelLayout or None, got tuple"),
        (Sharding, {"specs": ["x"]}, TypeError, "specs must be a mapping"),
        (Sharding, {"name_map": "x"}, TypeError, "name_map must be callable"),
        (FastTier, {"local_path": "s3://b/x"}, ValueError, "local_path must be a folder on this node"),
        (FastTier, {"local_path": "x", "replicas": 0}, ValueError, "replicas must be >= 1"),
        (FastTier, {"local_path": "x", "num_kept_local": 0}, ValueError, "num_kept_local must be >= 1"),
        (AsyncOptions, {"exit_status": 256}, ValueError, "exit_status must be an exit status 0..255 or None"),
        (AsyncOptions, {"overlap_staging": "no"}, TypeError, "overlap_staging must be True or False"),
        (ResumeOptions, {"strict": 1}, TypeError, "strict must be True or False, got 1"),
        (ResumeOptions, {"translate_function": "gpt2"}, TypeError, "translate_function must be callable"),
        (ResumeOptions, {"partial": False, "translate_function": len}, TypeError, "plain callables would need"),
    ],
)
def test_option_dataclasses_reject_bad_values_up_front(cls: Any, kw: dict[str, Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        cls(**kw)


def test_options_object_or_keywords_not_both(tmp_path: Any) -> None:
    m = _model()
    opts = (SaveOptions(save_rng=False), Retention(num_kept_partial_checkpoints=1))
    assert save_checkpoint(str(tmp_path), "a", model=m, options=opts) is None
    save_checkpoint(str(tmp_path), "b", model=m, options=opts)
    assert sorted(os.listdir(tmp_path)) == ["b_partial", "newest"]  # retention from the options object
    with pytest.raises(ValueError, match=r"^overwrite: pass options as keywords or as options=, not both$"):
        save_checkpoint(str(tmp_path), "c", model=m, overwrite=True, options=opts)
    with pytest.raises(TypeError, match="options must be a Sharding, .* or a sequence of them; got ResumeOptions"):
        save_checkpoint(str(tmp_path), "c", model=m, options=ResumeOptions())  # type: ignore[arg-type]
    dst = nn.Linear(3, 2)
    assert resume_from_checkpoint(str(tmp_path), model=dst, options=ResumeOptions(load_rng=False)) is None
    assert torch.equal(dst.weight, m.weight) and torch.equal(dst.bias, m.bias)
    with pytest.raises(ValueError, match=r"^strict: pass options"):
        resume_from_checkpoint(str(tmp_path), model=dst, strict=False, options=ResumeOptions())


def test_full_options_refuse_a_dtype_that_is_not_floating_point() -> None:
    # hunt73c F8 (older, MEDIUM): ExportOptions refused it, FullOptions (FullArtifactWriter, consolidate_checkpoint)
    # cast the weights into it: [1.7, -2.6, 300.0] written as int8 [1, -2, 44], as bool all True
    from smpckpt.storage import FullOptions

    for dtype in (torch.int8, torch.bool, torch.complex64):
        with pytest.raises(ValueError, match="dtype must be a floating-point torch.dtype"):
            FullOptions(dtype=dtype)
    assert FullOptions(dtype=torch.bfloat16).dtype == torch.bfloat16


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
    # hunt73c F6 (older, MEDIUM): with missing_ok the same mistake started fresh (None), the checkpoint never read;
    # so did the root and tag joined without the suffix ("{root}/t")
    from smpckpt.api.options import ResumeOptions

    for wrong in (tmp_path / "t_partial", tmp_path / "t"):
        with pytest.raises(CheckpointNotFound, match=r"(itself a checkpoint folder|joins a root and a tag).*tag='t'\)"):
            resume_from_checkpoint(str(wrong), model=_model(), options=ResumeOptions(missing_ok=True))
    assert (
        resume_from_checkpoint(str(tmp_path / "fresh"), model=_model(), options=ResumeOptions(missing_ok=True)) is None
    )


def test_a_save_into_a_checkpoint_folder_given_as_the_root_is_refused_by_name(tmp_path: Any) -> None:
    # hunt73c F7 (older, LOW-MEDIUM): save_checkpoint(<root>/t_partial, "u") made a root inside the checkpoint
    # folder (u_partial and newest nested in t_partial): a resume of the real root never saw u, and its retention
    # removing t_partial took u along. Refused before anything is written, naming the root to save to
    from smpckpt import Checkpointer, CheckpointError

    save_checkpoint(str(tmp_path), "t", model=_model())
    folder = tmp_path / "t_partial"
    before = sorted(os.listdir(folder))
    for call in (
        lambda: save_checkpoint(str(folder), "u", model=_model()),
        lambda: save_checkpoint(str(folder) + "/", "u", model=_model(), partial=False),  # an export nests alike
        lambda: Checkpointer(str(folder)).save("u", model=_model()),
    ):
        with pytest.raises(
            CheckpointError, match=rf"{folder} is itself a committed checkpoint \(tag 't'\) of the root {tmp_path}: "
        ) as info:
            call()
        assert f"save to {str(tmp_path)!r}" in str(info.value)
        assert sorted(os.listdir(folder)) == before
    assert sorted(os.listdir(tmp_path)) == ["newest", "t_partial"]
    # a stock DCP checkpoint folder as the root: refused alike (no root of ours)
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": _model().state_dict()}, checkpoint_id=str(tmp_path / "stock"))
    with pytest.raises(CheckpointError, match=r"stock is itself a checkpoint folder \(legacy\)"):
        save_checkpoint(str(tmp_path / "stock"), "u", model=_model())
    # the real root, an empty folder and a new one save as before
    for root in (tmp_path, tmp_path / "empty", tmp_path / "new"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        save_checkpoint(str(root), "u", model=_model())
        back = _model()
        with torch.no_grad():
            back.weight.zero_()
        resume_from_checkpoint(str(root), "u", model=back)
        assert torch.equal(back.weight, _model().weight)


def test_an_io_error_outside_dcp_is_a_checkpoint_error_naming_the_object(tmp_path: Any, monkeypatch: Any) -> None:
    """Listing tags or reading newest can fail mid-resume (an S3 endpoint dying): the caller gets our
    CheckpointError naming the object, with the OSError as its cause (issue 33 item 10)."""
    import errno

    import smpckpt.catalog.root as catalog  # what the resume lists the root with
    from smpckpt import CheckpointError

    save_checkpoint(str(tmp_path), "t", model=_model())

    def dead(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ECONNRESET, "Connection reset by peer", "bucket/run/t_partial/smpckpt.manifest.json")

    monkeypatch.setattr(catalog, "scan_root", dead)
    with pytest.raises(
        CheckpointError, match=r"resuming from .* failed: .*Connection reset.*t_partial/smpckpt\.manifest"
    ) as info:
        resume_from_checkpoint(str(tmp_path), model=_model())
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.parametrize("value", [float("nan"), -1.0])
def test_remove_uncommitted_older_than_is_refused_by_name(tmp_path: Any, value: float) -> None:
    """NaN passed "< 0" and then, unequal to itself, made one process report "arguments differ between ranks"."""
    with pytest.raises(
        ValueError, match=r"remove_uncommitted_older_than must be seconds >= 0 or None, got (nan|-1\.0)"
    ):
        save_checkpoint(str(tmp_path), "t", model=_model(), remove_uncommitted_older_than=value)
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("fn", ["save", "resume", "planner"])
def test_a_process_group_must_be_a_process_group(tmp_path: Any, fn: str) -> None:
    """Without a process group, any object was taken (and ignored): every rank would save alone."""
    from smpckpt import ParallelLayout
    from smpckpt.planners import ParallelLoadPlanner, ParallelSavePlanner

    match = r"process_group must be a torch.distributed ProcessGroup .* got object"
    with pytest.raises(TypeError, match=match):
        if fn == "save":
            save_checkpoint(str(tmp_path), "t", model=_model(), process_group=object())
        elif fn == "resume":
            resume_from_checkpoint(str(tmp_path), model=_model(), process_group=object())
        else:
            ParallelSavePlanner(ParallelLayout(), process_group=object())
    with pytest.raises(TypeError, match=match):
        ParallelLoadPlanner(ParallelLayout(), process_group=object())
    assert not os.listdir(tmp_path)


def test_a_full_save_without_a_model_names_model(tmp_path: Any) -> None:
    """rev61h F2: save_checkpoint(partial=False) without model= was refused asking for out=, a keyword
    save_checkpoint does not take (the export of a committed checkpoint's message)."""
    with pytest.raises(ValueError, match=r"partial=False\) writes a full checkpoint of model=: pass it"):
        save_checkpoint(str(tmp_path), "f", partial=False)


def _other_modes_keywords() -> list[tuple[bool, str]]:
    from smpckpt.api.calls import _MOVED, _SAVE_KEYWORDS

    return [(partial, n) for n in sorted(_SAVE_KEYWORDS) for partial in (True, False) if _MOVED[n][not partial] is None]


@pytest.mark.parametrize(("partial", "name"), _other_modes_keywords())
def test_the_other_modes_keyword_at_its_default_is_accepted_and_any_other_value_refused(
    tmp_path: Any, partial: bool, name: str
) -> None:
    """rev61h F3: smp accepts a keyword of the other kind of checkpoint at its default (its scripts pass
    them all); any other value is refused naming it. Nothing tested the accepting branch."""
    import warnings

    from smpckpt.api.calls import _MOVED

    default = getattr(_MOVED[name][1 if partial else 0], name, None)
    other = {"local_path": str(tmp_path / "fast"), "dtype": torch.float16, "hf_config": {}, "max_shard_size": 1 << 30}
    value = other.get(name, 60.0) if default is None else (not default if isinstance(default, bool) else default + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        save_checkpoint(str(tmp_path), "a", partial=partial, model=_model(), **{name: default})
        kind = "full" if partial else "partial"
        with pytest.raises(ValueError, match=rf"^{name} applies only to {kind} checkpoints"):
            save_checkpoint(str(tmp_path), "b", partial=partial, model=_model(), **{name: value})


def test_resume_options_partial_false_without_the_keyword_says_to_pass_it(tmp_path: Any) -> None:
    """rev62g aside: options=ResumeOptions(partial=False) alone was refused as "partial=True, but options
    holds ..." though the caller never passed partial=True (the smp keyword's default)."""
    from smpckpt import ResumeOptions

    with pytest.raises(ValueError, match=r"partial=True \(the default\), but .*: pass partial=False as well"):
        resume_from_checkpoint(str(tmp_path), model=nn.Linear(2, 2), options=ResumeOptions(partial=False))


def test_partial_false_with_resume_options_left_at_their_default_says_to_set_them(tmp_path: Any) -> None:
    """partial=False with options=ResumeOptions(strict=False) (its partial left at the default True) was told to
    pass partial=True, which resumes the other kind of checkpoint: the options are what to change."""
    from smpckpt import ResumeOptions

    with pytest.raises(ValueError, match=r"partial=False, but .*: give it partial=False too"):
        resume_from_checkpoint(str(tmp_path), partial=False, model=nn.Linear(2, 2), options=ResumeOptions(strict=False))
