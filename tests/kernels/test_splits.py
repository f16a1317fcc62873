"""Flash-decoding splits: how many a fixed count takes, and how many tokens each automatic split holds."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels.splits import choose_num_splits, choose_split_tokens


def test_choose_num_splits(monkeypatch):
    cpu = torch.device("cpu")
    assert choose_num_splits(4, 8, 100, cpu) == 1
    assert choose_num_splits(4, 8, 100_000, cpu) == 2
    props = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda", 0)
    assert choose_num_splits(1, 8, 8192, cuda) == 32  # few programs, long context: split widely
    assert choose_num_splits(1, 8, 1024, cuda) == 4  # capped by >= 256 tokens per split
    assert choose_num_splits(64, 8, 8192, cuda) == 1  # 512 programs already fill 132 SMs


def test_choose_split_tokens(monkeypatch):
    cpu = torch.device("cpu")
    assert choose_split_tokens(1000, 700, 8, 64, cpu) == 384  # at most two splits, tile-aligned
    props = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    cuda = torch.device("cuda", 0)
    assert choose_split_tokens(32768, 32768, 8, 64, cuda) == 1024  # 1 x 32k: 32 splits x 8 heads ~ 2 waves
    assert choose_split_tokens(64 * 32768, 32768, 8, 64, cuda) == 63552  # big batch: one split per sequence
    assert choose_split_tokens(600, 600, 8, 128, cuda) == 256  # at least MIN_TOKENS_PER_SPLIT
    assert choose_split_tokens(2**20, 2**20, 1, 64, cuda) == 8192  # at most MAX_SPLITS splits
