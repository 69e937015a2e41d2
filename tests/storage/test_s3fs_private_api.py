"""The private s3fs names smpckpt.storage.backends uses, pinned: each test fails, saying what to fix,
when the installed s3fs changes or removes one (the reason each is kept is beside its use in _s3.py).

* ``S3FileSystem._call_s3``: the coroutine behind the public ``call_s3`` (concurrent multipart parts);
  ``_fs.is_s3`` also tells s3fs by it.
* ``S3FileSystem._get_s3_method_kwargs``: the filesystem's extra request arguments, filtered per method
  (``_s3._one_attempt``: ranged GETs without s3fs's inner retry loop).
* ``s3fs.core._error_wrapper``: s3fs's retry policy and error translation (``_s3._retried``).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

s3fs = pytest.importorskip("s3fs")

from smpckpt.storage.backends import _s3  # noqa: E402
from smpckpt.storage.backends._fs import is_s3, open_fs  # noqa: E402


def _params(func: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(func).parameters.values()]


def test_call_s3_is_still_the_coroutine_behind_call_s3() -> None:
    fix = "fix S3MultipartSink._upload_part and _fs.is_s3 in storage/backends"
    func = getattr(s3fs.S3FileSystem, "_call_s3", None)
    assert func is not None, f"s3fs {s3fs.__version__} has no S3FileSystem._call_s3: {fix}"
    assert inspect.iscoroutinefunction(func), f"s3fs {s3fs.__version__}: _call_s3 is no coroutine: {fix}"
    P = inspect.Parameter
    assert _params(func)[:2] == [("self", P.POSITIONAL_OR_KEYWORD), ("method", P.POSITIONAL_OR_KEYWORD)], (
        f"s3fs {s3fs.__version__} changed _call_s3{inspect.signature(func)}: {fix}"
    )
    assert ("kwargs", P.VAR_KEYWORD) in _params(func), f"s3fs {s3fs.__version__}: _call_s3 takes no **kwargs: {fix}"


def test_get_s3_method_kwargs_adds_and_filters_the_filesystems_arguments(s3: tuple[str, dict[str, Any]]) -> None:
    """Against the moto server: the request arguments s3fs adds to every call (requester pays, extra
    kwargs) reach our one-attempt GET, filtered to what ``get_object`` accepts, and the GET works."""
    fix = "fix _s3._one_attempt in storage/backends (the filesystem's s3_additional_kwargs must still apply)"
    base, opts = s3
    fs, path = open_fs(f"{base}/pinned", {**opts, "requester_pays": True, "s3_additional_kwargs": {"ACL": "private"}})
    assert is_s3(fs)
    assert hasattr(fs, "_get_s3_method_kwargs"), f"s3fs {s3fs.__version__} has no _get_s3_method_kwargs: {fix}"

    async def client_of() -> Any:
        await fs.set_session()
        return await fs.get_s3()

    client = asyncio.run_coroutine_threadsafe(client_of(), fs.loop).result()
    got = fs._get_s3_method_kwargs(client.get_object, Bucket="b", Key="k")
    assert got == {"Bucket": "b", "Key": "k", "RequestPayer": "requester"}, (
        f"s3fs {s3fs.__version__}: _get_s3_method_kwargs(get_object) gave {got}: {fix}"
    )
    fs.pipe_file(f"{path}/x", b"\x00\x01pinned")
    assert _s3.get_object(fs, f"{path}/x") == b"\x00\x01pinned"


def test_error_wrapper_still_retries_and_translates(s3: tuple[str, dict[str, Any]]) -> None:
    """``_error_wrapper(func, *, args, kwargs, retries)`` awaits ``func``, retries what s3fs retries, and
    raises s3fs's translation of the rest (a missing key: ``FileNotFoundError``, which we name)."""
    from botocore.exceptions import ClientError

    fix = "fix _s3._retried in storage/backends"
    func = getattr(s3fs.core, "_error_wrapper", None)
    assert func is not None, f"s3fs {s3fs.__version__} has no s3fs.core._error_wrapper: {fix}"
    P = inspect.Parameter
    want = [("func", P.POSITIONAL_OR_KEYWORD), ("args", P.KEYWORD_ONLY), ("kwargs", P.KEYWORD_ONLY)]
    assert _params(func)[:3] == want and ("retries", P.KEYWORD_ONLY) in _params(func), (
        f"s3fs {s3fs.__version__} changed _error_wrapper{inspect.signature(func)}: {fix}"
    )
    base, opts = s3
    fs, path = open_fs(f"{base}/pinned", opts)
    calls: list[int] = []

    async def flaky(n: int) -> int:
        calls.append(n)
        if len(calls) == 1:
            raise s3fs.core.S3_RETRYABLE_ERRORS[0]("dropped")
        return n * 2

    assert _s3._retried(fs, flaky, 21) == 42 and calls == [21, 21], f"s3fs no longer retries as before: {fix}"

    async def missing() -> None:
        raise ClientError({"Error": {"Code": "NoSuchKey", "Message": "gone"}}, "GetObject")

    with pytest.raises(FileNotFoundError) as info:
        _s3._retried(fs, missing)
    assert isinstance(info.value.__cause__, ClientError), f"s3fs no longer translates as before: {fix}"
    with pytest.raises(FileNotFoundError) as real:  # the same, through the moto server
        _s3.get_range_into(fs, f"{path}/absent", 0, 4, [memoryview(bytearray(4))])
    # ours, naming the key <- s3fs's translation (errno-less since s3fs names none) <- botocore's ClientError
    named, translated = real.value, real.value.__cause__
    assert named.filename and isinstance(translated, FileNotFoundError), (named, translated)
    assert isinstance(translated.__cause__, ClientError), f"s3fs no longer translates as before: {fix}"
