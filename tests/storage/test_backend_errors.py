"""storage.backends._errors: S3's codes go through s3fs's table; ours is naming the object, keeping the
cause, and leaving smpckpt's own errors alone."""

from __future__ import annotations

import errno

import pytest

from smpckpt.errors import CheckpointCorrupt
from smpckpt.storage.backends._fs import translate, translate_errors

botocore_exceptions = pytest.importorskip("botocore.exceptions")
pytest.importorskip("s3fs")


def _client_error(code: str, **extra: str) -> Exception:
    return botocore_exceptions.ClientError({"Error": {"Code": code, "Message": f"{code}!", **extra}}, "PutObject")


@pytest.mark.parametrize(
    ("code", "extra", "cls", "num"),
    [
        ("NoSuchKey", {}, FileNotFoundError, errno.ENOENT),
        ("AccessDenied", {}, PermissionError, errno.EACCES),
        ("PreconditionFailed", {"Condition": "If-None-Match"}, FileExistsError, errno.EEXIST),
        ("InternalError", {}, OSError, getattr(errno, "EREMOTEIO", errno.EIO)),
        ("SomethingNew", {}, OSError, errno.EIO),
    ],
)
def test_a_raw_client_error_is_named_and_keeps_its_cause(code: str, extra: dict[str, str], cls: type, num: int) -> None:
    exc = _client_error(code, **extra)
    with pytest.raises(OSError) as info, translate_errors("bkt/ck/file.distcp"):
        raise exc
    got = info.value
    assert type(got) is cls and got.errno == num and got.filename == "bkt/ck/file.distcp", repr(got)
    assert got.__cause__ is exc


def test_s3fs_translations_without_the_key_are_named() -> None:
    s3fs_style = OSError(errno.EREMOTEIO, "We encountered an internal error.")
    got = translate(s3fs_style, "bkt/ck/a")
    assert type(got) is OSError and got.filename == "bkt/ck/a" and got.errno == errno.EREMOTEIO
    assert got.strerror == "We encountered an internal error." and got.__cause__ is s3fs_style


@pytest.mark.parametrize(
    "s3fs_style, num",
    [
        (FileExistsError("At least one of the pre-conditions you specified did not hold"), errno.EEXIST),
        (PermissionError("Access Denied"), errno.EACCES),
        (PermissionError("The provided token has expired."), errno.EACCES),
    ],
)
def test_s3fs_translations_without_an_errno_are_named(s3fs_style: OSError, num: int) -> None:
    """s3fs makes a refused ``If-None-Match: *``, AccessDenied and ExpiredToken ``FileExistsError(message)`` and
    ``PermissionError(message)``, without errno or key: a save denied its commit's LIST named nothing."""
    got = translate(s3fs_style, "bkt/ck/a")
    assert type(got) is type(s3fs_style) and got.filename == "bkt/ck/a" and got.errno == num, repr(got)
    assert got.strerror == str(s3fs_style) and got.__cause__ is s3fs_style


def test_a_stalled_get_s_timeout_names_the_file() -> None:
    """fsspec's ``FSTimeoutError`` (a GET stalled mid-body, past s3fs's retries) carries no message and no key: a
    resume failed with a bare ``FSTimeoutError: `` (rev72h L1). Named now, said to be transient."""
    from fsspec.exceptions import FSTimeoutError

    exc = FSTimeoutError()
    got = translate(exc, "bkt/ck/model.safetensors")
    assert type(got) is TimeoutError and got.errno == errno.ETIMEDOUT, repr(got)
    assert got.filename == "bkt/ck/model.safetensors" and got.__cause__ is exc
    assert got.strerror == "timed out (FSTimeoutError; transient: retry)", got.strerror


def test_ours_and_named_errors_and_others_pass_untouched() -> None:
    for exc in (CheckpointCorrupt("x"), FileNotFoundError(errno.ENOENT, "gone", "/a"), ValueError("v")):
        assert translate(exc, "/b") is exc


def test_transport_errors_become_oserror() -> None:
    exc = botocore_exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
    got = translate(exc, "bkt/x")
    assert type(got) is OSError and got.errno == errno.EIO and got.filename == "bkt/x" and got.__cause__ is exc
    assert str(got.strerror).startswith("EndpointConnectionError: ")


@pytest.mark.s3
def test_a_replacement_refused_by_if_match_on_s3_says_another_save_replaced_it(
    s3: tuple[str, dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another writer lands between ``replace_if``'s read and its ``If-Match`` PUT: the 412 arrives named by us
    over s3fs's translation over botocore's error, and ``precondition`` looked one cause deep: an
    ``OSError(EINVAL)`` instead of the ``FileExistsError`` the commit turns into "another save committed"."""
    from smpckpt.storage import open_fs
    from smpckpt.storage.backends import _s3
    from smpckpt.storage.backends._folder import Folder

    base, opts = s3
    fs, path = open_fs(f"{base}/ck", opts)
    fs.pipe_file(f"{path}/smpckpt.manifest.json", b"A")
    real = _s3.get_object_and_etag

    def read_then_overtaken(fs_: object, where: str) -> tuple[bytes, str]:
        got = real(fs_, where)
        fs.pipe_file(where, b"B")  # the other save's manifest lands right after this read
        return got

    monkeypatch.setattr(_s3, "get_object_and_etag", read_then_overtaken)
    with Folder(fs, path, create=False, follow=True) as folder:
        with pytest.raises(FileExistsError, match="another save replaced it meanwhile"):
            folder.replace_if("smpckpt.manifest.json", b"C", b"A", sync=True)
    monkeypatch.undo()
    assert fs.cat_file(f"{path}/smpckpt.manifest.json") == b"B"


@pytest.mark.s3
def test_a_create_refused_by_a_412_without_its_condition_is_recognised_on_s3(
    s3: tuple[str, dict[str, object]], moto_endpoint: str
) -> None:
    """rev68c F5: a store's 412 without ``<Condition>`` comes from s3fs as ``OSError(EINVAL)``: ``Folder.create``
    caught only ``FileExistsError``, so another's object was no "exists" and its own landed PUT (reply lost) a
    failure; the sink already asked ``precondition``."""
    import re

    import s3fs
    from storage_faulty_proxy import FaultyProxy

    from smpckpt.storage.backends._folder import Folder

    base, opts = s3
    lost: list[str] = []

    def strip(method: str, query: dict[str, list[str]], status: int, body: bytes) -> bytes:
        return re.sub(rb"<Condition>.*?</Condition>", b"", body) if status == 412 else body

    def fail_after(method: str, path: str, query: dict[str, list[str]]) -> int | None:
        if method == "PUT" and path.endswith("/lost") and not lost:
            lost.append(path)
            return 500
        return None

    with FaultyProxy(moto_endpoint, lambda *_: None, rewrite=strip, fail_after=fail_after) as proxy:
        popts = dict(opts, client_kwargs=dict(opts["client_kwargs"], endpoint_url=proxy.url))  # type: ignore[arg-type]
        fs = s3fs.S3FileSystem(**popts)
        path = f"{base[5:]}/nocond"
        fs.pipe_file(f"{path}/taken", b"another's")
        with Folder(fs, path) as folder:
            with pytest.raises(FileExistsError) as info:
                folder.create("taken", b"mine", sync=True)
            assert info.value.filename == f"{path}/taken", repr(info.value)
            folder.create("lost", b"mine", sync=True)  # landed, reply lost, the retry refused by itself: ours
        assert lost and fs.cat_file(f"{path}/taken") == b"another's" and fs.cat_file(f"{path}/lost") == b"mine"


@pytest.mark.s3
def test_an_object_removed_between_the_412_and_the_own_check_is_another_saves(
    s3: tuple[str, dict[str, object]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rev68c F3: a create refused (412) by another's object (another full save's marker) that is removed before
    the own-check reads it: the 404 of that GET/HEAD came out as ``FileNotFoundError``, not as the refusal."""
    from smpckpt.storage import open_fs
    from smpckpt.storage.backends import _s3
    from smpckpt.storage.backends._folder import Folder

    base, opts = s3
    fs, path = open_fs(f"{base}/gone", opts)
    fs.pipe_file(f"{path}/smpckpt.writing", b"other-save-id")
    real_get, real_call = _s3.get_object, fs.call_s3

    def get_after_removal(fs_: object, where: str) -> bytes:
        fs.rm_file(where)  # the other save's marker goes between our 412 and our GET
        return real_get(fs_, where)

    monkeypatch.setattr(_s3, "get_object", get_after_removal)
    with Folder(fs, path) as folder:
        with pytest.raises(FileExistsError) as info:
            folder.create("smpckpt.writing", b"my-save-id", sync=True)
    assert info.value.filename == f"{path}/smpckpt.writing", repr(info.value)
    monkeypatch.undo()

    def call_s3(method: str, **kw: object) -> object:
        if method == "head_object":
            fs.rm_file(f"{path}/x.distcp")  # removed between the refused PUT and the sink's HEAD
        return real_call(method, **kw)

    fs.pipe_file(f"{path}/x.distcp", b"another's")
    monkeypatch.setattr(fs, "call_s3", call_s3)
    sink = _s3.S3MultipartSink(fs, f"{path}/x.distcp", part_size=5 << 20, max_in_flight=1)
    sink.write(memoryview(b"mine"))
    with pytest.raises(FileExistsError) as info:
        sink.commit()
    assert info.value.filename == f"{path}/x.distcp", repr(info.value)
