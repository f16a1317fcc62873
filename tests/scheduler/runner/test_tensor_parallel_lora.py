"""LoRA on 2 gloo ranks: each rank holds its shard of every adapter (column-parallel B rows, row-parallel A columns,
the partial updates summed by the layers' all-reduce); outputs equal transformers with the adapters merged."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import merged, write_adapter
from sched_helpers import GREEDY, greedy_reference, make_engine

from scheduler import LoRAConfig, LoRARequest


@pytest.fixture(scope="module")
def adapters(tiny_hf, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-adapters")
    one = write_adapter(root / "one", tiny_hf, seed=1, rank=4)
    two = write_adapter(root / "two", tiny_hf, seed=2, rank=8, targets=("k_proj", "o_proj", "up_proj", "down_proj"))
    return [LoRARequest(name="one", path=one), LoRARequest(name="two", path=two)]


def test_a_mixed_batch_on_two_ranks_equals_the_merged_models(tiny_hf, prompts, adapters):
    torch.set_num_threads(1)
    loras = [adapters[0], adapters[1], None, adapters[0]]
    chosen = prompts[:4]
    # max_loras=1 with two adapters: the second waits, then takes the slot (a worker loads it in its turn)
    with make_engine(tiny_hf, tp=2, lora=LoRAConfig(max_loras=1, max_lora_rank=8), num_blocks=64, max_num_seqs=8,
                     max_num_batched_tokens=32) as engine:  # fmt: skip
        outs = engine.generate(chosen, GREEDY, lora_request=loras,
                               use_tqdm=False)  # fmt: skip
    want = [greedy_reference(merged(tiny_hf, r.path) if r else tiny_hf, [p])[0] for p, r in zip(chosen, loras)]
    assert [o.outputs[0].token_ids for o in outs] == want
