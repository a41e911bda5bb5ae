"""Model/mesh configuration: presets, JSON files, validation messages."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import pytest

from model_service.config import ConfigError, MeshConfig, load_model_config, model_config_to_dict, validate
from model_service.sharding import make_mesh
from tests.procs import GOLDEN, ROOT


def test_grok1_preset_has_the_reference_run_py_values() -> None:
    cfg = load_model_config("grok-1")
    assert (cfg.vocab_size, cfg.sequence_len, cfg.pad_token, cfg.eos_token) == (131072, 8192, 0, 2)
    t = cfg.model
    assert (t.emb_size, t.key_size, t.num_q_heads, t.num_kv_heads, t.num_layers) == (6144, 128, 48, 8, 64)
    assert (t.num_experts, t.num_selected_experts, t.ffn_size) == (8, 2, 32768)
    validate(cfg, MeshConfig(1, 8))


def test_golden_and_demo_json_files_load_and_validate() -> None:
    golden = load_model_config(str(GOLDEN / "config.json"))
    assert golden.model.ffn_size == 688 and golden.embedding_multiplier_scale == pytest.approx(78.38367176906169)
    demo = load_model_config(str(ROOT / "configs" / "demo.json"))
    assert (demo.vocab_size, demo.model.emb_size, demo.model.num_layers, demo.sequence_len) == (1024, 128, 4, 256)
    validate(demo, MeshConfig(1, 2))


def test_the_references_mesh_axis_names_are_read_only_as_data_and_model(tmp_path: pathlib.Path) -> None:
    values = json.loads((GOLDEN / "config.json").read_text())
    assert model_config_to_dict(load_model_config(str(GOLDEN / "config.json"))) == values  # the layout survives
    assert not hasattr(load_model_config(str(GOLDEN / "config.json")).model, "data_axis")  # no field pretends
    for key in ("data_axis", "model_axis"):
        without = json.loads(json.dumps(values))
        del without["model"][key]
        path = tmp_path / f"no_{key}.json"
        path.write_text(json.dumps(without))
        assert load_model_config(str(path)) == load_model_config(str(GOLDEN / "config.json"))
        renamed = json.loads(json.dumps(values))
        renamed["model"][key] = "batch"
        path.write_text(json.dumps(renamed))
        with pytest.raises(ConfigError, match=f"model.{key}: this service names its mesh axes"):
            load_model_config(str(path))


def test_unknown_or_missing_fields_are_named(tmp_path: pathlib.Path) -> None:
    values = json.loads((GOLDEN / "config.json").read_text())
    values["model"]["num_expertz"] = values["model"].pop("num_experts")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(values))
    with pytest.raises(ConfigError, match=r"unknown fields \['num_expertz'\], missing fields \['num_experts'\]"):
        load_model_config(str(path))
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model_config(str(tmp_path / "nope.json"))


def test_validation_explains_heads_not_divisible_by_the_model_axis() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    with pytest.raises(ConfigError, match=r"num_kv_heads \(8\) is not divisible by the model axis \(16\)"):
        validate(cfg, MeshConfig(1, 16))
    with pytest.raises(ConfigError, match=r"num_q_heads \(16\) is not divisible by the model axis \(3\)"):
        validate(cfg, MeshConfig(1, 3))


def test_validation_explains_more_selected_experts_than_experts() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_selected_experts=9))
    with pytest.raises(ConfigError, match=r"num_selected_experts \(9\) exceeds num_experts \(8\)"):
        validate(bad, MeshConfig())


def test_mesh_parsing_and_device_count_errors() -> None:
    assert MeshConfig.parse("2,4") == MeshConfig(2, 4)
    for text in ("8", "a,b", "0,1", "1,2,3,4", "1,0,2", "1,,2"):
        with pytest.raises(ConfigError):
            MeshConfig.parse(text)
    with pytest.raises(ConfigError, match="needs 16 devices but only 8"):
        make_mesh(MeshConfig(4, 4))


def test_three_mesh_numbers_are_data_expert_model_and_two_keep_meaning_data_model() -> None:
    assert MeshConfig.parse("1,8") == MeshConfig(data=1, model=8, expert=1)
    assert MeshConfig.parse("1,4,2") == MeshConfig(data=1, expert=4, model=2)
    assert MeshConfig.parse("2, 4, 1").size == 8
    assert str(MeshConfig.parse("1,4,2")) == "1,4,2" and str(MeshConfig.parse("1,8")) == "1,8"
    mesh = make_mesh(MeshConfig.parse("2,2,2"))
    assert mesh.axis_names == ("data", "expert", "model") and dict(mesh.shape) == {"data": 2, "expert": 2, "model": 2}
    assert dict(make_mesh(MeshConfig(1, 8)).shape) == {"data": 1, "expert": 1, "model": 8}


def test_validation_explains_an_expert_axis_that_cannot_hold_whole_experts() -> None:
    cfg = load_model_config(str(GOLDEN / "config.json"))
    for mesh in ("1,4,2", "1,8,1", "2,4,1", "1,2,4", "1,1,8"):
        validate(cfg, MeshConfig.parse(mesh))
    with pytest.raises(ConfigError, match=r"num_experts \(8\) is not divisible by the expert axis \(3\)"):
        validate(cfg, MeshConfig(expert=3))
    six = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_q_heads=12, num_kv_heads=6))
    validate(six, MeshConfig(model=3))
    with pytest.raises(ConfigError, match=r"the model axis \(3\) must divide the experts' 8 row blocks"):
        validate(six, MeshConfig(expert=2, model=3))
