"""Listings on S3 are read fresh: s3fs caches every listing in its filesystem object, which fsspec shares
across a process (no ``skip_instance_cache``, as users pass their options), so a process that listed the
root before another process saved resumed from what it had seen, not from what was committed."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from smpckpt import Location, resume_from_checkpoint, save_checkpoint
from smpckpt.catalog import scan_root


def _model(value: float) -> nn.Linear:
    m = nn.Linear(3, 2)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def test_a_tagless_resume_sees_a_checkpoint_another_process_committed_after_this_one_listed(
    s3_root: tuple[str, dict[str, Any]],
) -> None:
    root, options = s3_root
    # one filesystem object per process, as users get it (the suite's options skip fsspec's instance cache)
    shared = Location(root, storage_options={k: v for k, v in options.items() if k != "skip_instance_cache"})
    isolated = Location(root, storage_options=options)
    save_checkpoint(shared, "s1", model=_model(1.0), user_content={"tag": "s1"})
    assert resume_from_checkpoint(shared, model=_model(0.0)) == {"tag": "s1"}
    # "another process": a filesystem object of its own, whose writes cannot reach this one's cache
    save_checkpoint(isolated, "s2", model=_model(2.0), user_content={"tag": "s2"})

    assert [r.tag for r in scan_root(root, storage_options=shared.storage_options) if r.committed] == ["s1", "s2"]
    model = _model(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback: newest names a committed checkpoint
        assert resume_from_checkpoint(shared, model=model) == {"tag": "s2"}
    assert torch.equal(model.weight, torch.full((2, 3), 2.0))


def test_a_save_and_a_resume_build_one_s3_client_each_with_skip_instance_cache(
    s3_root: tuple[str, dict[str, Any]], monkeypatch: Any
) -> None:
    # skip_instance_cache=True (the suite's options; users may pass it too) made every open of the root a new
    # s3fs client, ~0.4 s each: 11 per save + resume (hunt66b r6), a 1,100-tag listing 560 s. A Checkpointer
    # (save_checkpoint and resume_from_checkpoint make one per call) reuses its first for its life
    import s3fs

    from smpckpt import Checkpointer

    root, options = s3_root
    assert options.get("skip_instance_cache") is True
    built: list[int] = []
    real = s3fs.S3FileSystem.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "__init__", counted)
    save_checkpoint(root, "s1", model=_model(1.0), storage_options=options, num_kept_partial_checkpoints=1)
    model = _model(0.0)
    resume_from_checkpoint(root, model=model, storage_options=options)
    assert len(built) == 2, f"{len(built)} S3FileSystem(s) built for a save and a resume"
    assert all(torch.equal(p, torch.full_like(p, 1.0)) for p in model.parameters())
    built.clear()
    ckpt = Checkpointer(Location(root, storage_options=options))
    ckpt.save("s2", model=_model(2.0))
    ckpt.resume(model=model)
    assert len(built) == 1, f"{len(built)} S3FileSystem(s) built by one Checkpointer's save and resume"
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())
    # sent to another process, the options are a plain dict again: no filesystem travels
    import pickle

    sent = pickle.loads(pickle.dumps(ckpt.location.storage_options))
    assert type(sent) is dict and sent == options


def _counted_clients(monkeypatch: Any) -> list[str]:
    """The endpoint of each S3FileSystem built from now on."""
    import s3fs

    built: list[str] = []
    real = s3fs.S3FileSystem.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        built.append(kwargs.get("client_kwargs", {}).get("endpoint_url"))
        real(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "__init__", counted)
    return built


def test_options_changed_after_the_location_was_built_open_a_filesystem_of_their_own(
    s3_root: tuple[str, dict[str, Any]], monkeypatch: Any
) -> None:
    # rev67b F1: the Location copied the caller's options and kept its first filesystem whatever they became:
    # the endpoint moved, the saves still went to the first one
    from smpckpt import Checkpointer

    root, options = s3_root
    first = options["client_kwargs"]["endpoint_url"]
    moved = first.replace("127.0.0.1", "localhost")  # the same server under another name
    built = _counted_clients(monkeypatch)
    ckpt = Checkpointer(Location(root, storage_options=options))
    ckpt.save("s1", model=_model(1.0))
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": moved}  # the caller's own dict
    ckpt.save("s2", model=_model(2.0))
    assert built == [first, moved], built
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": first}
    model = _model(0.0)
    ckpt.resume(model=model)
    assert built == [first, moved], built  # the first options' filesystem again
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model.parameters())


def test_a_location_pickled_or_copied_keeps_one_filesystem_for_its_life(
    s3_root: tuple[str, dict[str, Any]], monkeypatch: Any
) -> None:
    # rev67b F4: unpickled or deep-copied, a Location's options came back a plain dict: a client per open
    import copy
    import pickle

    from smpckpt import Checkpointer

    root, options = s3_root
    sent = (pickle.loads(pickle.dumps(Location(root, storage_options=options))), copy.deepcopy(Location(root, options)))
    for step, again in enumerate(sent, 1):
        built = _counted_clients(monkeypatch)
        assert again == Location(root, storage_options=options)
        ckpt = Checkpointer(again)
        ckpt.save(f"s{step}", model=_model(float(step)))
        model = _model(0.0)
        ckpt.resume(model=model)
        assert len(built) == 1, f"{len(built)} S3FileSystem(s) built by one Checkpointer's save and resume"
        assert all(torch.equal(p, torch.full_like(p, float(step))) for p in model.parameters())


def test_an_async_save_writes_with_the_options_it_was_called_with_whatever_the_caller_sets_later(
    s3_root: tuple[str, dict[str, Any]], monkeypatch: Any
) -> None:
    # rev67e F4: each open re-read the caller's dict: an endpoint moved right after save() returned sent the
    # background save's later writes there (its manifest: EndpointConnectionError, the save lost)
    import threading

    from s3_env import free_port

    from smpckpt import AsyncOptions, Checkpointer

    root, options = s3_root
    first = options["client_kwargs"]["endpoint_url"]
    held, real = threading.Event(), Checkpointer._write

    def write_later(self: Any, *args: Any) -> None:
        held.wait(30)  # the background write starts once the caller has moved the endpoint
        real(self, *args)

    monkeypatch.setattr(Checkpointer, "_write", write_later)
    ckpt = Checkpointer(Location(root, storage_options=options), async_options=AsyncOptions(enabled=True))
    ckpt.save("s1", model=_model(3.0), user_content={"tag": "s1"})
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": dead}
    held.set()
    ckpt.wait()
    ckpt.close()
    options["client_kwargs"] = {**options["client_kwargs"], "endpoint_url": first}
    model = _model(0.0)
    assert resume_from_checkpoint(Location(root, storage_options=options), model=model) == {"tag": "s1"}
    assert all(torch.equal(p, torch.full_like(p, 3.0)) for p in model.parameters())


def test_a_location_keeps_a_few_filesystems_when_its_options_keep_changing(
    s3_root: tuple[str, dict[str, Any]], monkeypatch: Any
) -> None:
    # rev67e F5: one filesystem (an S3 client) kept per distinct options for the Location's life: a secret
    # rotated at every save kept them all
    import gc
    import weakref

    import s3fs

    from smpckpt import Checkpointer
    from smpckpt.storage.backends._fs import KEPT

    root, options = s3_root
    alive: list[weakref.ref[Any]] = []
    real = s3fs.S3FileSystem.__init__

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        alive.append(weakref.ref(self))
        real(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "__init__", counted)
    location = Location(root, storage_options=options)
    ckpt = Checkpointer(location)
    alive.clear()  # (its own, for the options as they were)
    for step in range(KEPT + 4):
        options["secret"] = f"rotated-{step}"  # moto takes any secret
        ckpt.save(f"s{step}", model=_model(float(step)))
    assert len(alive) == KEPT + 4  # one per options' contents: each save kept its own
    options["secret"] = f"rotated-{KEPT + 2}"  # recently used: its filesystem again
    model = _model(0.0)
    ckpt.resume(model=model)
    assert len(alive) == KEPT + 4, f"{len(alive)} S3FileSystem(s) built"
    assert all(torch.equal(p, torch.full_like(p, float(KEPT + 3))) for p in model.parameters())
    gc.collect()
    assert len(location.storage_options.opened) == KEPT
    assert sum(ref() is not None for ref in alive) <= KEPT, "older filesystems still alive"


def test_no_filesystem_holds_the_callers_nested_options() -> None:
    """rev67g F1: s3fs keeps the ``client_kwargs`` dict it is given and connects on first use, so a filesystem
    built from the caller's own dict (the Checkpointer's key, a save's snapshot sharing it) followed an endpoint
    the caller changed in place after ``save()`` returned: a rank whose background write connected first then
    wrote to the new endpoint and the save was lost. Each filesystem is built from a copy to the leaves."""
    from smpckpt.storage.backends._fs import open_fs

    opts = {"anon": True, "skip_instance_cache": True, "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    for options in (opts, Location("s3://bucket/run", opts).storage_options):
        fs, _ = open_fs("s3://bucket/run", options)
        opts["client_kwargs"]["endpoint_url"] = "http://127.0.0.1:2"
        assert fs.client_kwargs == {"endpoint_url": "http://127.0.0.1:1"}, fs.client_kwargs
        opts["client_kwargs"]["endpoint_url"] = "http://127.0.0.1:1"
