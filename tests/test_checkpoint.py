"""Loading every checkpoint layout we accept, and a clear error for each one we refuse."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import TINY_TEXT, TINY_VISION, hf_tower_outputs, rel_err
from service.model.config import PRESETS, preset
from service.errors import CheckpointError
from service.model.loader import load_tower


def _tower_matches(tower, visual, grids=((1, 4, 6), (1, 2, 2))):
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, tower.config.patch_dim)
    with torch.no_grad():
        merged, ds = tower(pixels, tower.plan(grids))
    ref, ref_ds = hf_tower_outputs(visual, pixels, torch.tensor(grids))
    assert rel_err(merged, ref) <= 1e-5
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(ds, ref_ds))


def _hf_visual(path):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(path).eval().model.visual


def test_sharded_checkpoint_reads_only_vision_shards(sharded_checkpoint, monkeypatch):
    import service.model.checkpoint as ck

    opened = []
    real = ck.safe_open
    monkeypatch.setattr(ck, "safe_open", lambda f, **kw: opened.append(f) or real(f, **kw))
    tower, _ = load_tower(str(sharded_checkpoint))
    index = json.loads((sharded_checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    vision_files = {f for k, f in index.items() if k.startswith("model.visual.")}
    assert {p.rsplit("/", 1)[-1] for p in opened} == vision_files
    assert len(set(index.values())) > len(vision_files)  # language-model shards were never opened
    _tower_matches(tower, _hf_visual(sharded_checkpoint))


def test_legacy_visual_prefix(full_checkpoint, hf_model, tmp_path):
    shutil.copy(full_checkpoint / "config.json", tmp_path / "config.json")
    state = load_file(str(full_checkpoint / "model.safetensors"))
    save_file({k.replace("model.visual.", "visual.", 1): v for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    tower, pre = load_tower(str(tmp_path))
    assert pre.patch_size == 16 and pre.min_pixels == 65536  # no preprocessor_config.json: Qwen3-VL defaults
    _tower_matches(tower, hf_model.model.visual)


def test_vision_only_checkpoint(hf_model, tmp_path):
    hf_model.model.visual.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen3_vl_vision"
    tower, _ = load_tower(str(tmp_path))
    _tower_matches(tower, hf_model.model.visual)


def test_moe_checkpoint(tmp_path):
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(TINY_TEXT, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, decoder_sparse_step=1)
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(vision_config=TINY_VISION, text_config=text))
    model.save_pretrained(tmp_path)
    tower, _ = load_tower(str(tmp_path))
    _tower_matches(tower, model.eval().model.visual)


def test_presets_and_random_warning(caplog):
    assert preset("qwen3-vl-2b").head_dim == 64 and PRESETS["qwen3-vl-2b"].deepstack_visual_indexes == (5, 11, 17)
    c8 = preset("qwen3-vl-8b")
    assert (c8.depth, c8.hidden_size, c8.intermediate_size, c8.head_dim, c8.out_hidden_size) == (27, 1152, 4304, 72, 4096)
    with caplog.at_level("WARNING"):
        tower, _ = load_tower("random:tiny")
    assert "MEANINGLESS" in caplog.text
    a, _ = load_tower("random:tiny")
    assert all(torch.equal(p, q) for p, q in zip(tower.parameters(), a.parameters()))  # deterministic
    with pytest.raises(CheckpointError, match="unknown preset"):
        load_tower("random:nope")


# --- errors ------------------------------------------------------------------------------------------


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_pickle_only_directory_is_refused_without_unpickling(full_checkpoint, tmp_path):
    shutil.copy(full_checkpoint / "config.json", tmp_path / "config.json")
    # a file that would run code if unpickled: loading must refuse before ever opening it
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n(S'touch PWNED'\ntR.")
    with pytest.raises(CheckpointError, match="pickle"):
        load_tower(str(tmp_path))
    assert not (tmp_path / "PWNED").exists()


def test_wrong_model_type(full_checkpoint, tmp_path):
    d = _copy(full_checkpoint, tmp_path / "ck")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config.json.*'llama' is not a Qwen3-VL"):
        load_tower(str(d))


def test_missing_config_and_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_tower(str(tmp_path))
    with pytest.raises(CheckpointError, match="not a directory"):
        load_tower(str(tmp_path / "nope"))


def test_missing_shard(sharded_checkpoint, tmp_path):
    d = _copy(sharded_checkpoint, tmp_path / "ck")
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    victim = index["model.visual.blocks.1.attn.qkv.weight"]
    (d / victim).unlink()
    with pytest.raises(CheckpointError, match=f"{victim}.*does not exist"):
        load_tower(str(d))


def test_shape_mismatch_names_file_and_key(full_checkpoint, tmp_path):
    d = _copy(full_checkpoint, tmp_path / "ck")
    state = load_file(str(d / "model.safetensors"))
    state["model.visual.blocks.2.mlp.linear_fc1.weight"] = torch.zeros(7, 7)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model.safetensors.*'model.visual.blocks.2.mlp.linear_fc1.weight' "
                                             r"has shape \(7, 7\)"):
        load_tower(str(d))


def test_missing_tensor(full_checkpoint, tmp_path):
    d = _copy(full_checkpoint, tmp_path / "ck")
    state = load_file(str(d / "model.safetensors"))
    del state["model.visual.merger.norm.bias"]
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.visual.merger.norm.bias' missing"):
        load_tower(str(d))


def test_no_vision_weights(full_checkpoint, tmp_path):
    d = _copy(full_checkpoint, tmp_path / "ck")
    state = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in state.items() if "visual" not in k}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no vision tower weights"):
        load_tower(str(d))


def test_corrupt_safetensors(full_checkpoint, tmp_path):
    d = _copy(full_checkpoint, tmp_path / "ck")
    (d / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable"):
        load_tower(str(d))


def test_inconsistent_preprocessor_config(full_checkpoint, tmp_path):
    d = _copy(full_checkpoint, tmp_path / "ck")
    cfg = json.loads((d / "preprocessor_config.json").read_text())
    cfg["patch_size"] = 14
    (d / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="preprocessor_config.json.*disagree"):
        load_tower(str(d))
