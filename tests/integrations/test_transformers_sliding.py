"""PagedCache's sliding-window layers against transformers' DynamicCache, on tiny random Mistral and Qwen2 models."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from paged_kv.errors import InvalidArgumentError, OutOfRangeError, SequenceStateError  # noqa: E402
from paged_kv.integrations.transformers import PagedCache, PagedSlidingLayer, cache_keyword  # noqa: E402

SHAPE = dict(
    num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
    intermediate_size=128, max_position_embeddings=256,
)
WINDOW, PROMPT, NEW = 6, 20, 40
MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=0),
    "beams": dict(num_beams=3, do_sample=False),
}


def config(kind: str, window: int | None = WINDOW):
    """Mistral: every layer slides; Qwen2: layer 0 full, layers 1 and 2 slide (max_window_layers=1)."""
    if kind == "mistral":
        return MistralConfig(sliding_window=window, **SHAPE)
    return Qwen2Config(use_sliding_window=window is not None, sliding_window=window, max_window_layers=1, **SHAPE)


def build(kind: str, window: int | None = WINDOW):
    torch.manual_seed(0)
    cls = MistralForCausalLM if kind == "mistral" else Qwen2ForCausalLM
    return cls(config(kind, window)).eval()


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model(request):
    return build(request.param)


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three left-padded prompts of 20, 15 and 3 tokens (two longer than the window, one shorter)."""
    ids = torch.randint(1, 128, (3, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = mask[2, :17] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate(model, batch, cache, **kw) -> torch.Tensor:
    ids, mask = batch
    torch.manual_seed(2)  # the sampling mode draws the same numbers for every cache
    kw[cache_keyword(model)] = cache  # cache= from transformers 5.24, past_key_values= before
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW, pad_token_id=0, **kw)


@pytest.mark.parametrize(("mode", "block_size"), [("greedy", 1), ("greedy", 16), ("sampling", 4), ("beams", 4)])
def test_generate_is_token_identical_to_the_dynamic_cache(model, batch, mode, block_size):
    ref = generate(model, batch, DynamicCache(config=model.config), **MODES[mode])
    cache = PagedCache(model.config, block_size=block_size)
    assert torch.equal(generate(model, batch, cache, **MODES[mode]), ref)
    assert cache.is_sliding == [layer.is_sliding for layer in DynamicCache(config=model.config).layers]
    cache.sliding.store.pool.manager.check()


def test_the_window_decides_the_tokens(model, batch):
    # the same weights without the window generate other tokens: the tests above exercise the window
    kind = "mistral" if isinstance(model, MistralForCausalLM) else "qwen2"
    full = build(kind, window=None)
    full.load_state_dict(model.state_dict())
    windowed = generate(model, batch, PagedCache(model.config), do_sample=False)
    assert not torch.equal(generate(full, batch, DynamicCache(config=full.config), do_sample=False), windowed)


class PeakCache(PagedCache):
    """A PagedCache recording the pool pages its sliding layers hold after each single-token step."""

    peak = 0

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[2] == 1:
            self.peak = max(self.peak, self.sliding.store.pool.manager.gpu.num_used)
        return out


def test_pages_outside_the_window_go_back_to_the_pool(model, batch):
    block, rows = 4, batch[0].shape[0]
    cache = PeakCache(model.config, block_size=block)
    generate(model, batch, cache, do_sample=False)
    length = PROMPT + NEW - 1
    # held positions: the window's last WINDOW - 1, the new one, and at most block - 1 before them in a page
    bound = rows * -(-(WINDOW + block - 1) // block)
    assert 0 < cache.peak <= bound < rows * -(-length // block)
    store = cache.sliding.store
    assert store.pool.manager.gpu.num_used == store.num_pages <= bound
    assert cache.kv.num_pages == (rows * -(-length // block) if cache.kv.num_layers() else 0)  # full layers keep all
    store.pool.manager.check()


def forward(model, ids, *caches):
    with torch.no_grad():
        return [model(ids, **{cache_keyword(model): cache}).logits for cache in caches]


def assert_same_layers(ours: PagedCache, ref: DynamicCache) -> None:
    for a, b in zip(ours.layers, ref.layers, strict=True):
        assert a.is_sliding == b.is_sliding and a.get_seq_length() == b.get_seq_length()
        assert a.get_mask_sizes(3) == b.get_mask_sizes(3) and a.get_max_length() == b.get_max_length()
        # a sliding layer's keys are the window the next query sees (transformers' hold more while recording)
        seen = slice(-(WINDOW - 1), None) if b.is_sliding else slice(None)
        assert torch.equal(a.keys, b.keys[:, :, seen]) and torch.equal(a.values, b.values[:, :, seen])


def test_forward_chunks_match_the_dynamic_sliding_layers(model):
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    ours, ref = PagedCache(model.config, block_size=4), DynamicCache(config=model.config)
    for chunk in (ids[:, :2], ids[:, 2:10], ids[:, 10:11], ids[:, 11:16]):  # below, across and past the window
        got, want = forward(model, chunk, ours, ref)
        assert torch.equal(got, want)
        assert_same_layers(ours, ref)
    assert ours.get_max_length() == ref.get_max_length() == WINDOW


def test_recorded_past_rolls_back_like_transformers(model):
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(4))
    ours, ref = PagedCache(model.config, block_size=4), DynamicCache(config=model.config)
    forward(model, ids[:, :12], ours, ref)
    for cache in (ours, ref):
        cache.activate_past_recording()
    assert all(ours.is_recording_past(i) == ref.is_recording_past(i) for i in range(len(ref.layers)))
    forward(model, ids[:, 12:17], ours, ref)  # speculated tokens, 3 of them rejected next
    for cache in (ours, ref):
        cache.crop(-3)
    assert_same_layers(ours, ref)
    got, want = forward(model, ids[:, 14:18], ours, ref)
    assert torch.equal(got, want)
    assert_same_layers(ours, ref)


def test_a_crop_into_released_positions_raises_and_changes_nothing(model):
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(5))
    cache = PagedCache(model.config, block_size=4)
    forward(model, ids, cache)
    sliding = [layer for layer in cache.layers if isinstance(layer, PagedSlidingLayer)]
    before = [(layer.get_seq_length(), layer.keys) for layer in cache.layers], cache.num_pages
    for max_length in (-8, 6):  # 16 or 6 positions would need some of the 16 released (24 - 5 seen, page-aligned)
        with pytest.raises(SequenceStateError, match=f"^max_length={max_length}: expected a crop"):
            cache.crop(max_length)
        with pytest.raises(SequenceStateError, match="^max_length="):
            sliding[0].crop(max_length)
    after = [(layer.get_seq_length(), layer.keys) for layer in cache.layers], cache.num_pages
    assert before[1] == after[1] and all(
        n == m and torch.equal(k, j) for (n, k), (m, j) in zip(before[0], after[0], strict=True)
    )
    cache.crop(-2)  # still held: the window's positions before the crop point are in the pages
    assert cache.get_seq_length() == 22 and sliding[0].keys.shape[2] == WINDOW - 1


def test_assisted_decoding_matches_the_dynamic_cache(model):
    prompt = torch.tensor([[5, 6, 7, 8, 9] * 4])  # repeats, so prompt lookup proposes candidates
    kw = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)
    key = cache_keyword(model)
    ref = model.generate(prompt, **{key: DynamicCache(config=model.config)}, **kw)
    assert torch.equal(model.generate(prompt, **{key: PagedCache(model.config, block_size=4)}, **kw), ref)


def test_deepcopy_and_reset(model, batch):
    ids = batch[0][:1]
    cache = PagedCache(model.config, block_size=4)
    forward(model, ids[:, :12], cache)
    twin = copy.deepcopy(cache)
    assert twin.sliding.store.pool is cache.sliding.store.pool
    assert all(layer.rows is twin.sliding for layer in twin.layers if isinstance(layer, PagedSlidingLayer))
    keys = [layer.keys for layer in cache.layers]
    ref = DynamicCache(config=model.config)
    forward(model, ids[:, :12], ref)
    got, want = forward(model, ids[:, 12:], twin, ref)  # the copy goes on, the original is unchanged
    assert torch.equal(got, want) and all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, keys))
    cache.reset()
    assert cache.num_pages == 0 and cache.get_seq_length() == 0 and not cache.is_initialized
    assert all(layer.get_seq_length() == 0 for layer in cache.layers)


def test_unsupported_window_configs_are_refused_by_name():
    types = lambda first: LlamaConfig(num_hidden_layers=2, layer_types=[first, "full_attention"])  # noqa: E731
    cases = [
        (types("sliding_attention"), "config.sliding_window"),  # a sliding layer without a window
        (MistralConfig(sliding_window=1, **SHAPE), "config.sliding_window"),  # transformers keeps every position then
        (types("chunked_attention"), "config.layer_types"),
    ]
    wrong_count = config("qwen2")
    wrong_count.layer_types = ["full_attention"] * 2  # 3 layers
    cases.append((wrong_count, "config.layer_types"))
    for cfg, name in cases:
        with pytest.raises(InvalidArgumentError, match=f"^{name}="):
            PagedCache(cfg)
    cache = PagedCache(config("mistral"))
    with pytest.raises(OutOfRangeError, match="^layer_idx="):  # the config fixes the layers
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 3)
    assert cache.num_pages == 0 and len(cache) == 3
