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


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


_DROP = object()


@pytest.mark.parametrize("changes,message", [
    (dict(hidden_size=_DROP), r"config\.json: 'hidden_size' is missing"),
    (dict(num_hidden_layers="five"), r"config\.json: 'num_hidden_layers' must be a positive integer, not 'five'"),
    (dict(num_attention_heads=0), r"'num_attention_heads' must be a positive integer, not 0"),
    (dict(vocab_size=-3), r"'vocab_size' must be a positive integer"),
    (dict(intermediate_size=True), r"'intermediate_size' must be a positive integer, not True"),
    (dict(num_key_value_heads=2.5), r"'num_key_value_heads' must be a positive integer, not 2\.5"),
])
def test_a_broken_config_names_the_file_and_the_field(stories_copy: Path, changes: dict, message: str) -> None:
    """Operator input: a hand-edited or half-downloaded config.json is a ValueError naming the
    file and the field, not a KeyError or a division by zero from deep inside."""
    _edit_config(stories_copy, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(stories_copy)


def test_config_that_is_not_json(stories_copy: Path) -> None:
    (stories_copy / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        load_model(stories_copy)
    (stories_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        load_model(stories_copy)


@pytest.mark.parametrize("cut", [1000, "half"])
def test_a_truncated_weights_file_is_named(stories_copy: Path, cut) -> None:
    weights = stories_copy / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) // 2 if cut == "half" else cut])
    with pytest.raises(ValueError, match=r"cannot read the weights file .*model\.safetensors.*truncated or corrupt"):
        load_model(stories_copy)


def test_weights_that_do_not_fit_the_config(stories_copy: Path) -> None:
    _edit_config(stories_copy, hidden_size=128)
    with pytest.raises(ValueError, match=r"weight 'model\.embed_tokens\.weight' has shape \(512, 64\), which does "
                                         r"not fit the model config\.json describes \(hidden_size 128"):
        load_model(stories_copy)


def test_a_directory_without_a_tokenizer(stories_copy: Path) -> None:
    for f in stories_copy.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match="cannot load the tokenizer of .*tokenizer.json"):
        load_model(stories_copy)
