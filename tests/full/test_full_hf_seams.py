"""Where full exports meet Hugging Face: the offline and online paths write one artifact (tied heads
included), translations that do not fit the model are refused, ``config.json`` states the dtype written,
a TP=1 model in our names exports without specs, and ``consolidate_checkpoint`` takes ``PATH/TAG``
(tier 1, one process)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from full_models import assert_state_equal, trained_model
from safetensors.torch import load_file

import smpckpt
from smpckpt.tools.consolidate import consolidate_checkpoint
from smpckpt.tools.convert import convert_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_consolidate_and_convert_take_path_slash_tag_as_the_cli_does(tmp_path: Path) -> None:
    model, _ = trained_model(0)
    root = str(tmp_path / "run")
    smpckpt.save_checkpoint(root, "step3", model=model, save_rng=False)
    report = consolidate_checkpoint(os.path.join(root, "step3"), tmp_path / "full", progress=False)
    assert "model.safetensors" in report["files"]
    got = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert_state_equal(model.state_dict(), got)
    converted = convert_checkpoint(Path(root) / "step3", tmp_path / "one.pt")
    assert converted["tensors"] == len(model.state_dict())
    back = torch.load(tmp_path / "one.pt", weights_only=True)
    assert_state_equal(model.state_dict(), back["model"])


class _WithExtraState(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
        self.extra: dict[str, Any] = {"note": "saved", "k": 1}

    def get_extra_state(self) -> dict[str, Any]:
        return dict(self.extra)

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.extra = dict(state)


def test_consolidate_keeps_the_models_objects_as_the_online_export_does(tmp_path: Path) -> None:
    # a module's extra_state (non-tensor model state): the online export writes it as <key>.pt, the offline
    # consolidation left it out, so its artifact was not the same and a resume from it lost that state
    root = str(tmp_path / "run")
    model = _WithExtraState()
    smpckpt.save_checkpoint(root, "step3", model=model, save_rng=False)
    smpckpt.save_checkpoint(root, "online", model=model, partial=False)
    consolidate_checkpoint(os.path.join(root, "step3"), tmp_path / "offline", progress=False)
    online, offline = sorted(os.listdir(os.path.join(root, "online"))), sorted(os.listdir(tmp_path / "offline"))
    assert [n for n in online if not n.startswith(".metadata")] == [n for n in offline if not n.startswith(".metadata")]
    assert {"model._extra_state.note.pt", "model._extra_state.k.pt"} <= set(offline)
    back = _WithExtraState()
    back.extra = {"note": "other", "k": 2}
    with torch.no_grad():
        back.w.zero_()
    smpckpt.resume_from_checkpoint(str(tmp_path / "offline"), partial=False, model=back)
    assert back.extra == {"note": "saved", "k": 1} and torch.equal(back.w, model.w)


@pytest.fixture
def gpt2() -> Any:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()

    def make(seed: int, **overrides: Any) -> Any:
        torch.manual_seed(seed)
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=32, **overrides)
        return GPT2LMHeadModel(cfg).eval()

    return make


def _config_json(folder: Path) -> dict[str, Any]:
    with open(folder / "config.json") as f:
        return json.load(f)


def test_config_json_states_the_dtype_written_not_the_configs(tmp_path: Path, gpt2: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = gpt2(0)
    model.save_pretrained(tmp_path / "pretrained")  # its config now says float32
    saved = _config_json(tmp_path / "pretrained")
    assert saved["dtype"] == "float32"
    root = str(tmp_path / "run")
    smpckpt.save_checkpoint(root, "bf", partial=False, model=model, dtype=torch.bfloat16, hf_config=model.config)
    assert _config_json(tmp_path / "run" / "bf")["dtype"] == "bfloat16"
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "bf")
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.transformer.wte.weight, model.transformer.wte.weight.to(torch.bfloat16))
    # offline, from a config.json that spells it the older way
    smpckpt.save_checkpoint(root, "p", model=model, save_rng=False)
    old = {k: v for k, v in saved.items() if k != "dtype"} | {"torch_dtype": "float32"}
    consolidate_checkpoint(
        os.path.join(root, "p"), tmp_path / "off", dtype=torch.float16, hf_config=old, progress=False
    )
    written = _config_json(tmp_path / "off")
    assert written["torch_dtype"] == "float16" and "dtype" not in written
    # and without a cast, the dtype of the weights as they are
    smpckpt.save_checkpoint(root, "fp32", partial=False, model=model, hf_config={**saved, "dtype": "bfloat16"})
    assert _config_json(tmp_path / "run" / "fp32")["dtype"] == "float32"


@pytest.mark.parametrize(
    "names", [("pytorch_model.bin",), ("pytorch_model.bin.index.json", "pytorch_model-00001-of-00001.bin")]
)
def test_a_hugging_face_folder_of_torch_save_weights_is_named_so_not_called_an_unfinished_save(
    tmp_path: Path, names: tuple[str, ...]
) -> None:
    # transformers' older save_pretrained (or safe_serialization=False) writes torch.save weights; only safetensors
    # folders load without a manifest, and the refusal must say that rather than call it a failed save of ours
    model = torch.nn.Linear(3, 2)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "custom"}))
    for name in names:
        if name.endswith(".json"):
            (folder / name).write_text(json.dumps({"weight_map": {"weight": names[1], "bias": names[1]}}))
        else:
            torch.save(model.state_dict(), folder / name)
    with pytest.raises(smpckpt.CheckpointNotFound) as info:
        smpckpt.resume_from_checkpoint(str(folder), partial=False, model=torch.nn.Linear(3, 2))
    text = str(info.value)
    assert names[0] in text and "Hugging Face" in text and "safetensors" in text and "uncommitted" not in text, text


def test_consolidate_holds_one_tensor_per_writing_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "memory about twice the largest tensor" (README): each file's thread kept the tensor it had just written
    # alive while it read the next (24 x 128 MiB consolidated at +514 MiB, 4x). Each tensor handed to the
    # writer lives in a numpy array here, alive while any view of it is: gone before its thread asks again.
    import threading
    import weakref

    import numpy as np

    from smpckpt.tools import consolidate as cons

    model = torch.nn.ParameterList(torch.nn.Parameter(torch.full((64, 64), float(i))) for i in range(6))
    root = str(tmp_path / "run")
    smpckpt.save_checkpoint(root, "s", model=model, options=smpckpt.SaveOptions(save_rng=False))
    resolve, last, alive_at_next = cons._OneTensorAtATime.resolve_data, {}, []

    def tracked(self: Any, item: Any) -> Any:
        previous = last.get(threading.get_ident())
        if previous is not None and previous[1]() is not None:
            alive_at_next.append(previous[0])
        value = resolve(self, item)
        if not isinstance(value, torch.Tensor):
            return value
        arr = np.empty(tuple(value.shape), dtype=np.float32)
        out = torch.from_numpy(arr).copy_(value)
        last[threading.get_ident()] = (item.index.fqn, weakref.ref(arr))
        return out

    monkeypatch.setattr(cons._OneTensorAtATime, "resolve_data", tracked)
    consolidate_checkpoint(os.path.join(root, "s"), tmp_path / "full", progress=False)
    got = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert_state_equal(model.state_dict(), got)
    assert alive_at_next == [], f"tensors still held when their thread read the next: {alive_at_next}"
