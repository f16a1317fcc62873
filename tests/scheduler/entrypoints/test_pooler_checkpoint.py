"""The pooling a checkpoint declares (sentence-transformers files, Matryoshka fields), and LLM taking it."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from paged_kv.errors import InvalidArgumentError
from scheduler.core.config import CacheConfig, EngineConfig
from scheduler.core.pooling_params import PoolerConfig
from scheduler.entrypoints.llm import LLM
from scheduler.entrypoints.pooler_checkpoint import checkpoint_pooler_config

PLAIN = SimpleNamespace()  # a model config with no Matryoshka field


def _sentence_transformers(folder, pooling: dict | None, normalize: bool) -> None:
    """Write sentence-transformers' modules.json (and 1_Pooling/config.json when ``pooling``) into ``folder``."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def test_qwen3_embedding_style_files_mean_last_token_normalized(tmp_path):
    _sentence_transformers(tmp_path, {"word_embedding_dimension": 64, "pooling_mode_lasttoken": True,
                                      "pooling_mode_mean_tokens": False}, normalize=True)  # fmt: skip
    assert checkpoint_pooler_config(tmp_path, PLAIN) == PoolerConfig(pooling_type="LAST", normalize=True)


def test_mean_pooling_without_normalize_and_matryoshka_from_the_model_config(tmp_path):
    _sentence_transformers(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=False)
    hf = SimpleNamespace(matryoshka_dimensions=[32, 64])
    assert checkpoint_pooler_config(tmp_path, hf) == PoolerConfig(pooling_type="MEAN", normalize=False,
                                                                  is_matryoshka=True, matryoshka_dimensions=(32, 64))


def test_nothing_declared_is_none_and_an_unsupported_mode_is_refused(tmp_path):
    assert checkpoint_pooler_config(tmp_path, PLAIN) is None
    assert checkpoint_pooler_config(None, SimpleNamespace(is_matryoshka=True)) == PoolerConfig(is_matryoshka=True)
    _sentence_transformers(tmp_path, {"pooling_mode_cls_token": True}, normalize=True)
    with pytest.raises(InvalidArgumentError, match="pooling_mode_lasttoken"):
        checkpoint_pooler_config(tmp_path, PLAIN)


def test_llm_takes_the_checkpoints_pooling_unless_its_config_sets_one(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    _sentence_transformers(folder, {"pooling_mode_mean_tokens": True}, normalize=False)
    engine = EngineConfig(cache=CacheConfig(block_size=4, num_gpu_blocks=64), device="cpu")
    assert LLM(folder, engine_config=engine).engine.config.pooler_config == PoolerConfig(pooling_type="MEAN",
                                                                                          normalize=False)
    mine = PoolerConfig(pooling_type="LAST", normalize=False)
    chosen = LLM(folder, engine_config=EngineConfig(cache=engine.cache, device="cpu", pooler_config=mine))
    assert chosen.engine.config.pooler_config == mine
    # the defaults chosen explicitly are a choice too: the checkpoint's MEAN does not replace them
    defaults = LLM(folder, engine_config=EngineConfig(cache=engine.cache, device="cpu", pooler_config=PoolerConfig()))
    assert defaults.engine.config.pooler_config == PoolerConfig() and defaults.engine.pooler.config == PoolerConfig()
