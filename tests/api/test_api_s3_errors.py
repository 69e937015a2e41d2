"""S3 failures reach the caller as smpckpt's errors naming the object, the backend's error kept as the cause:
an endpoint that is down (a closed loopback port) while a save, a full save, a resume or ``smpckpt ls``
reads ``newest`` or lists the root, and an ``s3://`` location that names no bucket."""

from __future__ import annotations

import io
from typing import Any

import pytest
from s3_env import free_port, s3_options
from torch import nn

from smpckpt import resume_from_checkpoint, save_checkpoint
from smpckpt.errors import CheckpointError
from smpckpt.tools.cli import main


def _down() -> dict[str, Any]:
    """Options for an endpoint nobody listens on; one attempt per request (refused at once)."""
    options = s3_options(f"http://127.0.0.1:{free_port()}")
    options["config_kwargs"] = {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 2}
    return options


def _causes(exc: BaseException) -> list[str]:
    names = []
    cause = exc.__cause__
    while cause is not None:
        names.append(type(cause).__name__)
        cause = cause.__cause__
    return names


@pytest.mark.parametrize("call", ["save", "full save", "resume"])
def test_an_endpoint_that_is_down_is_a_checkpoint_error_naming_the_object(call: str) -> None:
    options, model = _down(), nn.Linear(2, 2)
    with pytest.raises(CheckpointError) as info:
        if call == "save":
            save_checkpoint("s3://bkt/run", "t", model=model, save_rng=False, storage_options=options)
        elif call == "full save":
            save_checkpoint("s3://bkt/run", "t", model=model, partial=False, storage_options=options)
        else:
            resume_from_checkpoint("s3://bkt/run", model=model, storage_options=options)
    message = str(info.value)
    assert "EndpointConnectionError" in message and "'bkt/run" in message, message
    assert info.value.__cause__ is not None, "the backend's error must stay the cause"
    if call == "resume":  # outside dcp.load: our OSError naming the object, botocore's error under it
        assert _causes(info.value) == ["OSError", "EndpointConnectionError"], _causes(info.value)


def test_ls_with_the_endpoint_down_fails_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.setenv("SMPCKPT_STORAGE_OPTIONS", json.dumps(_down()))
    err = io.StringIO()
    assert main(["ls", "s3://bkt/run"], stdout=io.StringIO(), stderr=err) == 1
    assert "EndpointConnectionError" in err.getvalue() and "'bkt/run" in err.getvalue(), err.getvalue()


@pytest.mark.parametrize("call", ["save", "resume", "ls"])
def test_an_s3_location_without_a_bucket_is_refused_by_name(s3_root: tuple[str, dict[str, Any]], call: str) -> None:
    """Against a live (moto) endpoint: botocore would refuse the empty key ("ParamValidationError")."""
    _, options = s3_root
    model = nn.Linear(2, 2)
    if call == "ls":
        import json

        err = io.StringIO()
        status = main(["ls", "s3://", "--storage-options", json.dumps(options)], stdout=io.StringIO(), stderr=err)
        assert status == 1 and "must name a bucket" in err.getvalue() and "'s3://'" in err.getvalue(), err.getvalue()
        return
    with pytest.raises(CheckpointError, match=r"must name a bucket .*'s3://'") as info:
        if call == "save":
            save_checkpoint("s3://", "t", model=model, save_rng=False, storage_options=options)
        else:
            resume_from_checkpoint("s3://", model=model, storage_options=options)
    assert isinstance(info.value.__cause__, OSError)
    # the bucket's own root still works
    save_checkpoint(s3_root[0], "t", model=model, save_rng=False, storage_options=options)
