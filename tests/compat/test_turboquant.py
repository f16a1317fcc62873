"""The TurboQuant-style quantiser under facade 002: config, bit packing, codebook, rotation, records."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from paged_kv.compat import turboquant
from paged_kv.compat.turboquant import KvCacheConfig, TurboQuantizer, lloyd_max_codebook, pack_bits, unpack_bits
from paged_kv.errors import InvalidArgumentError, PagedKVError

D = 16
CFG = KvCacheConfig(D, 4, 32, 7)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- KvCacheConfig -------------------------------------------------------------
def test_config_positional_and_keyword_frozen_and_record_size():
    assert KvCacheConfig(64, 4, 32, 99) == KvCacheConfig(head_dim=64, bits=4, projections=32, seed=99)
    cfg = KvCacheConfig(np.int64(10), 3, 12, 2**64 - 1)  # NumPy ints accepted, stored as int
    assert type(cfg.head_dim) is int
    assert cfg.record_bytes == 4 + 2 + 8  # ceil(10*3/8) code bytes, ceil(12/8) sign bytes, two float32 norms
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.bits = 5


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(head_dim=0), "head_dim"), (dict(bits=0), "bits"), (dict(bits=17), "bits"),
        (dict(projections=0), "projections"), (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"),
        (dict(bits=2.5), "bits"), (dict(head_dim=True), "head_dim"), (dict(seed="1"), "seed"),
    ],
)
def test_config_rejects_bad_values_naming_them(kwargs, name):
    args = dict(head_dim=8, bits=4, projections=8, seed=0) | kwargs
    with pytest.raises(InvalidArgumentError, match=name) as info:
        KvCacheConfig(**args)
    assert isinstance(info.value, (PagedKVError, ValueError))


# -- bit packing and the codebook ----------------------------------------------
@pytest.mark.parametrize("bits", range(1, 17))
def test_bit_packing_round_trips_every_width(bits):
    codes = torch.randint(0, 1 << bits, (3, 13), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, math.ceil(13 * bits / 8))
    assert torch.equal(unpack_bits(packed, 13, bits).long(), codes)


def test_lloyd_max_codebook_matches_known_gaussian_limits():
    # For large head_dim a rotated coordinate is ~ N(0, 1/d): the 1-bit levels are +-sqrt(2/(pi d)),
    # and the MSE per unit vector is 1 - 2/pi (1 bit), ~0.117 (2 bits), ~0.0095 (4 bits).
    d = 512
    one = lloyd_max_codebook(d, 1)
    assert torch.allclose(one, torch.tensor([-1.0, 1.0], dtype=torch.float64) * math.sqrt(2 / (math.pi * d)), rtol=2e-3)
    x = randn(4000, d, seed=1).double()
    x /= x.norm(dim=1, keepdim=True)
    for bits, want in ((1, 1 - 2 / math.pi), (2, 0.117), (4, 0.0095)):
        c = lloyd_max_codebook(d, bits)
        q = c[torch.bucketize(x, (c[1:] + c[:-1]) / 2)]
        assert float(((x - q) ** 2).sum(1).mean()) == pytest.approx(want, rel=0.05)
    assert torch.equal(lloyd_max_codebook(1, 1), torch.tensor([-1.0, 1.0], dtype=torch.float64))


# -- TurboQuantizer ------------------------------------------------------------
def test_rotation_is_orthogonal_and_matrices_follow_the_seed():
    a, b = TurboQuantizer([CFG]), TurboQuantizer([CFG])
    other = TurboQuantizer([dataclasses.replace(CFG, seed=8)])
    r = a.rotation[0]  # [d, d]
    assert torch.allclose(r @ r.T, torch.eye(D), atol=1e-5)
    assert a.sketch.shape == (1, CFG.projections, D)
    assert torch.equal(a.rotation, b.rotation) and torch.equal(a.sketch, b.sketch)
    assert not torch.equal(a.rotation, other.rotation) and not torch.equal(a.sketch, other.sketch)


def test_records_hold_codes_signs_and_float32_norms():
    tq = TurboQuantizer([CFG])
    x = randn(1, 5, D, seed=3) * 7
    x[0, 2] = 0  # the zero vector: zero norms, decodes to zero
    rec = tq.encode(x)  # [1, 5, R]
    assert rec.dtype == torch.uint8 and rec.shape == (1, 5, CFG.record_bytes)
    norms = rec[0, :, -8:].clone().view(torch.float32)  # [5, 2]: norm, residual norm
    assert torch.allclose(norms[:, 0], x[0].norm(dim=-1)) and bool((norms[:, 1] >= 0).all())
    assert norms[2].tolist() == [0.0, 0.0] and not tq.decode(rec, with_residual=True)[0, 2].any()
    codes = unpack_bits(rec[0, :, : CFG.code_bytes], D, CFG.bits)  # [5, d]
    direction = x[0] / x[0].norm(dim=-1, keepdim=True).clamp_min(1e-30)
    want = torch.bucketize(direction @ tq.rotation[0].T, tq.bounds)
    assert torch.equal(codes[[0, 1, 3, 4]].long(), want[[0, 1, 3, 4]])


def test_a_long_vector_keeps_its_codes_signs_and_scaled_norms():
    # norm 3e38 fits a float32, and so must its residual norm: no overflow on the way (float64 norms,
    # signs from the residual's direction)
    tq = TurboQuantizer([CFG])
    x = randn(1, 4, D, seed=5)
    scale = 3e38 / float(x.norm(dim=-1).max())
    small, large = tq.encode(x), tq.encode(x * scale)
    tail = CFG.code_bytes + CFG.sign_bytes
    assert torch.equal(small[..., :tail], large[..., :tail])
    assert bool(torch.isfinite(tq.norms(large)).all())
    assert torch.allclose(tq.norms(large).double(), tq.norms(small).double() * scale, rtol=1e-5)
    assert torch.equal(tq.norms(small), small[..., tail:].clone().view(torch.float32))


def test_head_h_of_a_batch_is_the_quantiser_of_its_seed():
    configs = [CFG, dataclasses.replace(CFG, seed=8)]
    batch, single = TurboQuantizer(configs), TurboQuantizer(configs[1:])
    head = batch.head(1)
    assert head.config == configs[1] and torch.equal(head.rotation, single.rotation)
    x, q = randn(2, 6, D, seed=4), randn(2, D, seed=5)
    scores = batch.inner_products(batch.encode(x), q)  # [2, 6]
    alone = single.inner_products(single.encode(x[1:]), q[1:])
    assert torch.allclose(scores[1:], alone, rtol=1e-5, atol=1e-6)
    with pytest.raises(InvalidArgumentError, match="configs"):
        TurboQuantizer([CFG, dataclasses.replace(CFG, bits=3)])


def test_long_inputs_are_scored_and_decoded_in_slices(monkeypatch):
    tq = TurboQuantizer([CFG, dataclasses.replace(CFG, seed=8)])
    records, q = tq.encode(randn(2, 40, D, seed=1)), randn(2, D, seed=12)  # records: [2, 40, R]
    whole = (tq.inner_products(records, q), tq.decode(records, with_residual=True))
    monkeypatch.setattr(turboquant, "_CHUNK", 3 * 2 * max(D, CFG.projections))  # 3 tokens per slice
    assert len(tq._chunks(records)) == 14
    sliced = (tq.inner_products(records, q), tq.decode(records, with_residual=True))
    assert torch.equal(whole[0], sliced[0]) and torch.allclose(whole[1], sliced[1], atol=1e-6)
    empty = records[:, :0]
    assert tq.inner_products(empty, q).shape == (2, 0) and tq.decode(empty).shape == (2, 0, D)
