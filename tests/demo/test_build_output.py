"""What a demo build hands over: tensor files under 5 MB for both presets' configs (refused before training
otherwise), and the tar parts a chip run brings back, which join into the demo folder's items."""

from __future__ import annotations

import dataclasses
import io
import pathlib
import tarfile

import pytest

from model_service.config import load_model_config, validate, MeshConfig
from model_service.model.params import tensor_specs
from demo_build import export, record
from demo_build.presets import PRESETS, ROOT, corpus_dirs
from demo_build.train_tokenizer import corpus_files


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_presets_checkpoint_files_stay_under_5_mb(name: str) -> None:
    cfg = load_model_config(str(ROOT / PRESETS[name].config))
    validate(cfg, MeshConfig())
    export.check_tensor_files(cfg)
    assert max(map(export.tensor_payload_bytes, tensor_specs(cfg))) < export.MAX_TENSOR_FILE_BYTES


def test_a_config_with_a_tensor_file_of_5_mb_is_refused_before_training() -> None:
    cfg = load_model_config(str(ROOT / PRESETS["tpu"].config))
    wide = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, widening_factor=4.0))
    with pytest.raises(ValueError, match="moe/linear"):
        export.check_tensor_files(wide)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_presets_corpus_exists_in_files_under_5_mb(name: str) -> None:
    folders = corpus_dirs(PRESETS[name].corpus)
    files = [path for pattern in ("*.txt", "*.jsonl") for path in corpus_files(folders, pattern)]
    assert files and max(path.stat().st_size for path in files) < 5_000_000


def test_tar_parts_join_into_the_demo_folders_items(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    (out / "checkpoint" / "ckpt-0").mkdir(parents=True)
    payload = bytes(range(256)) * 40
    (out / "checkpoint" / "ckpt-0" / "tensor00000_000").write_bytes(payload)
    for name in ("tokenizer.model", "config.json", "training.json"):
        (out / name).write_text(name)
    parts = record.write_tar(out, tmp_path / "tar", part_bytes=4096)
    assert len(parts) > 2 and all(part.stat().st_size <= 4096 for part in parts)
    assert [part.name for part in parts] == sorted(part.name for part in parts)
    with tarfile.open(fileobj=io.BytesIO(b"".join(part.read_bytes() for part in parts))) as tar:
        names = tar.getnames()
        assert tar.extractfile("demo/checkpoint/ckpt-0/tensor00000_000").read() == payload  # type: ignore[union-attr]
    assert {"demo/tokenizer.model", "demo/config.json", "demo/training.json"} <= set(names)
