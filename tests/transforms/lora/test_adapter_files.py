"""``load_adapter`` on an ``adapter_model.safetensors`` that is truncated, empty or
garbage, with the manifest ``save_adapter`` wrote (its checksum names the file) and
without (as peft writes one: safetensors' own reading fails): a ``CheckpointError``
naming the file, the model's adapters untouched. One process."""

from __future__ import annotations

import os

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(120)


def _damage(path: str, how: str) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write({"truncated": data[: len(data) // 2], "empty": b"",
                            "garbage": os.urandom(len(data))}[how])


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    import torch.distributed as dist
    from peft import LoraConfig

    import meshlab as ml

    had = dist.is_initialized()
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = ml.parallelize(M.build("llama"), ml.lora(cfg), ml.Mesh(dp=1), seed=0)
    path = str(tmp_path_factory.mktemp("adapter") / "a")
    ml.save_adapter(path, model)
    yield path, model
    if not had and dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no_manifest"])
@pytest.mark.parametrize("how", ["truncated", "empty", "garbage"])
def test_a_damaged_adapter_file_is_a_checkpoint_error(adapter, tmp_path, how, manifest):
    import shutil

    import meshlab as ml
    from meshlab.checkpoint import CheckpointError

    path, model = adapter
    d = str(tmp_path / "a")
    shutil.copytree(path, d)
    if not manifest:
        os.remove(os.path.join(d, "meshlab.manifest.json"))
    _damage(os.path.join(d, "adapter_model.safetensors"), how)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.fill_(0.5)
    with pytest.raises(CheckpointError, match="adapter_model.safetensors") as e:
        ml.load_adapter(d, model)
    named = ({"garbage": "its SHA-256"}.get(how, "is truncated: it has") if manifest
             else "cannot be read")
    assert named in str(e.value), str(e.value)
    assert all(torch.all(p == 0.5) for n, p in model.named_parameters() if ".lora_" in n)
