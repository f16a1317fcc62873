"""PagedCache: a transformers Cache on paged storage, driven by a tiny random Llama's generate()."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from paged_kv.errors import InvalidArgumentError, OutOfRangeError, PagedKVError  # noqa: E402
from paged_kv.integrations.transformers import PagedCache, cache_keyword  # noqa: E402

PROMPT, NEW = 20, 12


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
        intermediate_size=128, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 128, (2, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def greedy_ref(model, prompt) -> torch.Tensor:
    return generate(model, prompt, DynamicCache(config=model.config))


class RecordingCache(PagedCache):
    """A PagedCache that records the peak of the bytes its pages hold."""

    peak = 0

    def update(self, *args, **kwargs):
        out = super().update(*args, **kwargs)
        self.peak = max(self.peak, self.nbytes)
        return out

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        self.peak = max(self.peak, self.nbytes)


def generate(model, prompt, cache, **kw) -> torch.Tensor:
    kw[cache_keyword(model)] = cache  # cache= from transformers 5.24, past_key_values= before
    return model.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0, **kw)


def test_greedy_generate_matches_the_default_cache(model, prompt, greedy_ref):
    cache = PagedCache(model.config, block_size=8)
    assert torch.equal(generate(model, prompt, cache), greedy_ref)
    assert cache.get_seq_length() == PROMPT + NEW - 1 and cache.kv.batch_size() == 2
    assert cache.num_pages == 2 * -(-(PROMPT + NEW - 1) // 8)


def test_beam_search_matches_the_default_cache_and_holds_fewer_bytes(model, prompt):
    ref_cache = DynamicCache(config=model.config)
    ref = generate(model, prompt, ref_cache, num_beams=4)
    cache = RecordingCache(model.config, block_size=8)
    assert torch.equal(generate(model, prompt, cache, num_beams=4), ref)
    dense = sum(layer.keys.nbytes + layer.values.nbytes for layer in ref_cache.layers)
    print(f"\nbeam search (2 prompts x 4 beams, {PROMPT}+{NEW} tokens): DynamicCache {dense} B, "
          f"PagedCache peak {cache.peak} B, final {cache.nbytes} B")
    assert cache.peak < dense and cache.nbytes < dense / 2
    cache.kv.pool.manager.check()


def test_no_config_layers_are_added_on_demand(model, prompt):
    cache = PagedCache()
    assert len(cache) == 0
    ref = generate(model, prompt[:1], DynamicCache())
    assert torch.equal(generate(model, prompt[:1], cache), ref)
    assert len(cache) == 2 and cache.layers[1].get_seq_length() == PROMPT + NEW - 1


def test_forward_keys_values_and_cache_api(model, prompt):
    cache, ref = PagedCache(model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, **{cache_keyword(model): cache})
        model(prompt, **{cache_keyword(model): ref})
    for ours, theirs in zip(cache.layers, ref.layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
        assert ours.is_initialized and ours.dtype == torch.float32 and ours.device.type == "cpu"
    assert cache.get_seq_length() == PROMPT and cache.get_mask_sizes(3, 0) == (PROMPT + 3, 0)
    assert cache.get_max_length() == -1 and cache.is_croppable and not cache.is_compileable
    assert cache.is_sliding == [False, False]


def test_early_initialization_sets_empty_layers(model, prompt, greedy_ref):
    cache = PagedCache(model.config)
    cache.early_initialization(batch_size=2, num_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    assert cache.is_initialized and cache.get_seq_length() == 0 and cache.layers[0].keys.shape == (2, 2, 0, 16)
    assert torch.equal(generate(model, prompt, cache), greedy_ref)


def test_reorder_and_batch_edits_are_block_table_edits(model, prompt):
    cache = PagedCache(model.config, block_size=4)
    with torch.no_grad():
        model(prompt, **{cache_keyword(model): cache})
    keys = cache.layers[1].keys
    used = cache.kv.pool.manager.gpu.num_used
    cache.reorder_cache(torch.tensor([1, 1]))
    assert cache.kv.pool.manager.gpu.num_used == used // 2  # row 0's pages went back
    assert torch.equal(cache.layers[1].keys, keys[[1, 1]])
    cache.batch_repeat_interleave(2)
    cache.batch_select_indices(torch.tensor([3, 0, 1]))
    assert cache.kv.batch_size() == 3 and cache.kv.pool.manager.gpu.num_used == used // 2
    assert torch.equal(cache.layers[0].values, ref_values(model, prompt[[1, 1, 1]]))


def ref_values(model, prompt) -> torch.Tensor:
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt, **{cache_keyword(model): ref})
    return ref.layers[0].values


def test_crop_both_conventions_and_reset_return_pages(model, prompt):
    cache = PagedCache(model.config, block_size=4)
    with torch.no_grad():
        model(prompt, **{cache_keyword(model): cache})
    keys = cache.layers[0].keys
    cache.crop(0)
    assert cache.get_seq_length() == PROMPT
    cache.crop(-5)  # transformers 5: drop 5 tokens
    assert cache.get_seq_length() == PROMPT - 5 and torch.equal(cache.layers[0].keys, keys[:, :, :-5])
    cache.crop(6)  # transformers 4: keep 6 tokens
    assert [layer.get_seq_length() for layer in cache.layers] == [6, 6] and cache.num_pages == 2 * 2
    cache.layers[0].crop(-6)
    assert cache.layers[0].get_seq_length() == 0 and cache.num_pages == 2 * 2  # layer 1 still uses them
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.num_pages == 0 and not cache.is_initialized


def test_deepcopy_shares_pages_and_diverges(model, prompt):
    cache = PagedCache(model.config, block_size=4)
    with torch.no_grad():
        model(prompt[:1, :8], **{cache_keyword(model): cache})
    used = cache.kv.pool.manager.gpu.num_used
    twin = copy.deepcopy(cache)
    assert twin.kv.pool is cache.kv.pool and cache.kv.pool.manager.gpu.num_used == used
    assert all(layer.store is twin.kv for layer in twin.layers)
    keys = cache.layers[0].keys
    with torch.no_grad():  # prompt reuse: continue the copy, the original is unchanged
        model(prompt[:1, 8:10], **{cache_keyword(model): twin})
    assert twin.get_seq_length() == 10 and torch.equal(cache.layers[0].keys, keys)


def test_errors_are_typed():
    with pytest.raises(InvalidArgumentError, match="^config.layer_types"):
        PagedCache(LlamaConfig(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"]))
    cache = PagedCache()
    with pytest.raises(OutOfRangeError, match="^layer_idx="):
        cache.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), -1)
    with pytest.raises(InvalidArgumentError, match="^max_length="):
        cache.crop("3")
    with pytest.raises(InvalidArgumentError, match="^key.shape"):
        cache.update(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), 0)
    assert len(cache) == 0 and cache.kv.num_layers() == 0
    with pytest.raises(PagedKVError, match="^repeats="):
        cache.batch_repeat_interleave(0)


def test_cache_keyword_is_the_keyword_the_model_fills_the_cache_by(model, prompt):
    # "cache" from transformers 5.24 on, "past_key_values" before: a wrong keyword would leave the cache empty
    cache = PagedCache(model.config, block_size=8)
    model(prompt, **{cache_keyword(model): cache})
    assert cache.get_seq_length() == PROMPT and cache.num_pages > 0
