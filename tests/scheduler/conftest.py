"""Shared fixtures: a tiny random Llama (with its transformers twin), its greedy references, SmolLM2."""

from __future__ import annotations

import pytest
import torch
from sched_helpers import SHARED, VOCAB, greedy_reference, tiny_llama


@pytest.fixture(autouse=True)
def _one_thread():
    """Small matmuls run fastest on one thread, and CI runs two test workers on two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_hf():
    """A seeded random LlamaForCausalLM: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256, float32."""
    return tiny_llama(seed=0)


@pytest.fixture(scope="session")
def looping_hf():
    """A tiny LlamaForCausalLM with small weights: its greedy outputs fall into loops (n-gram drafts get accepted)."""
    return tiny_llama(seed=0, initializer_range=0.02)


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Prompts of different lengths; three share a 40-token prefix, one is a single token."""
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    return [rand(5), SHARED + rand(9), rand(33), SHARED + rand(23), rand(1), SHARED + rand(2), rand(64)]


@pytest.fixture(scope="session")
def beam_prompts() -> list[list[int]]:
    """Prompts of 1, 6, 17 and 40 tokens (block size 4: partial and full last blocks)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (1, 6, 17, 40)]


@pytest.fixture(scope="session")
def hf_greedy(tiny_hf, prompts) -> list[list[int]]:
    """transformers' greedy continuation of every prompt (NUM_NEW tokens each)."""
    return greedy_reference(tiny_hf, prompts)


@pytest.fixture(scope="session")
def smollm2():
    """(transformers model, tokenizer) of SmolLM2-135M-Instruct, loaded once per session."""
    from scheduler.model.loader import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A local transformers folder: a seeded random 2-layer Llama (safetensors) and a tiny BPE tokenizer."""
    from text_helpers import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def looping_model_dir(tmp_path_factory):
    """As ``tiny_model_dir``, with small weights: greedy outputs fall into loops (n-gram drafts get accepted)."""
    from text_helpers import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("looping-llama"), initializer_range=0.02)
