"""load_model: what it accepts, what it refuses (with a message that says why), atomic caching."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from keyserve.model import gguf_convert
from keyserve.model.loader import load_model, resolve_model_dir
from keyserve.model.paths import models_dir


@pytest.fixture
def stories_copy(tmp_path: Path, stories_path: str) -> Path:
    out = tmp_path / "stories"
    shutil.copytree(stories_path, out)
    return out


def test_loads_hf_dir_with_tokenizer(stories_path: str) -> None:
    loaded = load_model(stories_path)
    assert loaded.path == Path(stories_path)
    assert loaded.config.vocab_size == 512 and loaded.tokenizer.vocab_size == 512
    assert loaded.generation_config.get("eos_token_id") == 2
    assert loaded.model.lm_head_weight is loaded.model.model.embed_tokens.weight  # tied


def test_bfloat16_weights(stories_path: str) -> None:
    model = load_model(stories_path, dtype=torch.bfloat16).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_config_json_path_means_its_directory(stories_path: str) -> None:
    assert resolve_model_dir(str(Path(stories_path) / "config.json")) == Path(stories_path)


def test_sharded_safetensors_index(stories_copy: Path, stories_path: str) -> None:
    tensors = load_file(str(stories_copy / "model.safetensors"))
    (stories_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(stories_copy / file))
        weight_map.update({k: file for k in keys})
    (stories_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_model(stories_copy).model.state_dict()
    single = load_model(stories_path).model.state_dict()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_unknown_path() -> None:
    with pytest.raises(FileNotFoundError, match=r"no such path .*nowhere.*config\.json"):
        load_model("/definitely/nowhere")


def test_dir_without_config(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("hi")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_pickle_only_dir_is_refused(stories_copy: Path) -> None:
    (stories_copy / "model.safetensors").rename(stories_copy / "pytorch_model.bin")
    with pytest.raises(ValueError, match="pickle.*pytorch_model.bin"):
        load_model(stories_copy)
    (stories_copy / "config.json").unlink()
    with pytest.raises(ValueError, match="pickle"):
        load_model(stories_copy)
    with pytest.raises(ValueError, match="pickle"):
        load_model(stories_copy / "pytorch_model.bin")


def test_config_without_weights(stories_copy: Path) -> None:
    (stories_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(stories_copy)


def test_missing_and_unexpected_weights(stories_copy: Path) -> None:
    tensors = load_file(str(stories_copy / "model.safetensors"))
    gone = tensors.pop("model.layers.2.mlp.down_proj.weight")
    save_file(tensors, str(stories_copy / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weights.*layers.2.mlp.down_proj"):
        load_model(stories_copy)
    tensors["model.layers.2.mlp.down_proj.weight"] = gone
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, str(stories_copy / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight.*q_norm"):
        load_model(stories_copy)


def test_several_ggufs_are_ambiguous(tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF"):
        load_model(tmp_path)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KEYSERVE_CACHE_DIR", str(tmp_path))
    assert models_dir() == tmp_path / "models"


def test_interrupted_conversion_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A conversion killed half-way leaves neither the destination nor its temp dir."""
    monkeypatch.setattr(gguf_convert, "gguf_architecture", lambda path: "llama")

    def half_then_interrupt(src: Path, tmp: Path, progress: bool) -> None:
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_convert_into", half_then_interrupt)
    out = tmp_path / "models" / "m"
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.convert_gguf(tmp_path / "m.gguf", out)
    assert list((tmp_path / "models").iterdir()) == []

    def complete(src: Path, tmp: Path, progress: bool) -> None:
        (tmp / gguf_convert.CONVERSION_MANIFEST).write_text("{}")

    monkeypatch.setattr(gguf_convert, "_convert_into", complete)
    assert gguf_convert.convert_gguf(tmp_path / "m.gguf", out) == out
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["m"]


def test_conversion_refusals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gguf_convert, "gguf_architecture", lambda path: "gemma3")
    with pytest.raises(ValueError, match="architecture 'gemma3' is not supported"):
        gguf_convert.convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    (tmp_path / "half").mkdir()
    with pytest.raises(FileExistsError, match="not a finished keyserve conversion"):
        gguf_convert.convert_gguf(tmp_path / "m.gguf", tmp_path / "half")
