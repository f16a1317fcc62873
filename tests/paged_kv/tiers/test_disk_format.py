"""The model fingerprint and the block file format: encoding, names, exact sizes and every rejection."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from disk_helpers import BS, FP16, batch, chain, fingerprint, same_bits

from paged_kv.block_hash import HASH_SCHEME
from paged_kv.errors import InvalidArgumentError, OutOfRangeError, PagedKVError
from paged_kv.kv_cache import STORAGE_DTYPES, KVCacheSpec
from paged_kv.tiers.disk_format import RejectedFile, decode, encode, file_bytes, file_name, name_tag, read_header
from paged_kv.tiers.fingerprint import FORMAT_VERSION, ModelFingerprint


@pytest.mark.parametrize("dtype", STORAGE_DTYPES, ids=str)
def test_from_spec_agrees_with_the_cache_spec(dtype):
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, dtype=dtype)
    fp = ModelFingerprint.from_spec(spec, "LlamaForCausalLM")
    assert fp.torch_dtype == dtype and fp.hash_scheme == HASH_SCHEME
    assert (fp.quantized, fp.bytes_per_block) == (spec.quantized, spec.bytes_per_block)
    assert fp.kv_shape == (2, 3, 8, 2, 16) and fp.scales_shape == (2, 3, 8, 2)


def test_metadata_round_trip_and_tags():
    meta = FP16.to_metadata()
    assert all(isinstance(v, str) for v in meta.values())
    assert ModelFingerprint.from_metadata(meta) == FP16
    tags = {fingerprint(**{f.name: v}).tag for f, v in zip(dataclasses.fields(FP16), ("A", 3, 3, 16, "int8", 8, "x"))}
    assert len(tags | {FP16.tag}) == 8 and all(len(t) == 16 for t in tags)


@pytest.mark.parametrize(("field", "value", "error"), [
    ("architecture", "", InvalidArgumentError), ("architecture", 3, InvalidArgumentError),
    ("num_layers", 0, OutOfRangeError), ("head_dim", 1 << 15, OutOfRangeError),
    ("dtype", "float13", InvalidArgumentError), ("dtype", torch.float16, InvalidArgumentError),
    ("block_size", True, InvalidArgumentError), ("hash_scheme", " ", InvalidArgumentError),
])  # fmt: skip
def test_bad_fingerprint_fields_raise_naming_them(field, value, error):
    with pytest.raises(error, match=f"^{field}="):
        fingerprint(**{field: value})


@pytest.mark.parametrize("text", ["", "-3", " 3", "03", "3.0", "٣"])
def test_from_metadata_wants_plain_decimal_integers(text):
    with pytest.raises(PagedKVError, match="num_layers"):
        ModelFingerprint.from_metadata(FP16.to_metadata() | {"num_layers": text})
    with pytest.raises(InvalidArgumentError, match="meta="):
        ModelFingerprint.from_metadata({"architecture": "Toy"})
    with pytest.raises(InvalidArgumentError, match="spec="):
        ModelFingerprint.from_spec("spec", "Toy")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"])
def test_encode_decode_round_trip_and_exact_sizes(tmp_path, dtype):
    fp = fingerprint(dtype=dtype)
    blocks = chain(range(3 * BS))[3]
    kv, scales = batch(fp, blocks)
    data = encode(fp, blocks, kv, scales)
    assert len(data) == file_bytes(fp, 3) and file_bytes(fp, 1) < file_bytes(fp, 3) < 3 * file_bytes(fp, 1)
    got, kv2, scales2 = decode(data, fp)
    assert list(got) == blocks and same_bits(kv2, kv)
    assert scales2 is None if scales is None else same_bits(scales2, scales)
    path = tmp_path / file_name(fp, blocks)
    path.write_bytes(data)
    assert list(read_header(path, fp)) == blocks and name_tag(path.name) == fp.tag
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    assert meta["format"] == FORMAT_VERSION and meta["hashes"].split(",")[0] == blocks[0].hash.hex()


def test_names_derive_from_the_model_and_the_blocks():
    a, b = chain(range(2 * BS))[3], chain(range(1, 2 * BS + 1))[3]
    assert file_name(FP16, a) == file_name(FP16, list(a))
    assert len({file_name(FP16, a), file_name(FP16, b), file_name(fingerprint(dtype="int8"), a)}) == 3
    assert name_tag(file_name(FP16, a)) == FP16.tag
    assert name_tag(".tmp-1-abc") is None and name_tag("kv-xyz.safetensors") is None


def test_decode_rejects_other_models_as_foreign_and_damage_as_corrupt():
    blocks = chain(range(2 * BS))[3]
    data = encode(FP16, blocks, *batch(FP16, blocks))
    with pytest.raises(RejectedFile, match="another model") as foreign:
        decode(data, fingerprint(head_dim=4))
    assert foreign.value.foreign
    for spoiled in (data[:-1], data[:100], b"", data[:8] + b"[]" + data[10:]):
        with pytest.raises(RejectedFile) as corrupt:
            decode(spoiled, FP16)
        assert not corrupt.value.foreign


def test_decode_checks_dtypes_and_shapes_behind_a_valid_header():
    blocks = chain(range(2 * BS))[3]
    kv, _ = batch(FP16, blocks)
    as_int16 = encode(FP16, blocks, kv.view(torch.int16), None)  # right bytes, wrong dtype
    with pytest.raises(RejectedFile, match="dtypes"):
        decode(as_int16, FP16)
    one_block = encode(FP16, blocks, kv[:1], None)  # header lists 2 blocks, tensor has 1
    with pytest.raises(RejectedFile, match="shapes"):
        decode(one_block, FP16)
