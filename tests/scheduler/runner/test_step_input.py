"""The engine's hot path on the CPU: building and running a step reads no device value on the host.

On a GPU each such read is a device sync (and breaks CUDA-graph capture); the guard makes them
raise, so this runs in CI without one. The step's logits must still be the model's: they are
compared with transformers' on the same sequences.
"""

from __future__ import annotations

import pytest
import torch
from no_host_reads import forbid_host_reads
from sched_helpers import make_engine

from scheduler import SamplingParams
from scheduler.runner.sampler import sample


def _hf_last_logits(hf, seqs) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack([hf(torch.tensor([s.token_ids])).logits[0, -1].float() for s in seqs])


def _guarded_step(engine):
    out = engine.scheduler.schedule()
    with forbid_host_reads():
        step = engine.runner.inputs.build(out)
        logits = engine.runner.execute(step)
    return out, step, logits


@pytest.mark.parametrize("mixed", [False, True], ids=["decode", "prefill+decode"])
def test_a_step_reads_no_device_value_and_gives_the_models_logits(tiny_hf, prompts, mixed):
    engine = make_engine(tiny_hf, max_num_batched_tokens=64)
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8))
    engine.step()  # prefill (chunked over the budget)
    engine.step()
    if mixed:
        engine.add_request("late", prompts[6], SamplingParams(max_tokens=8))
    out, step, logits = _guarded_step(engine)
    assert step.meta.is_decode != mixed
    sampled = [s.seq for s in out.scheduled if s.samples]
    assert logits.shape[0] == len(sampled) >= 4
    torch.testing.assert_close(logits, _hf_last_logits(tiny_hf, sampled), atol=2e-4, rtol=2e-4)


def test_the_sampler_makes_one_device_to_host_transfer(monkeypatch):
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or original(self))
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, logprobs=3), SamplingParams(top_p=0.5),
              SamplingParams(temperature=1.0, top_p=0.9, seed=3), SamplingParams(logprobs=2)]  # fmt: skip
    gens = [None, None, None, torch.Generator().manual_seed(3), None]
    result = sample(logits, params, gens)
    assert len(reads) == 1
    logprobs = torch.log_softmax(logits, -1)
    assert result.token_ids[0] == int(logits[0].argmax()) and result.token_ids[4] == int(logits[4].argmax())
    for row, token in enumerate(result.token_ids):
        assert result.logprobs[row] == pytest.approx(float(logprobs[row, token]), abs=1e-5)
    top = logprobs[1].topk(3)
    assert list(result.top_logprobs[1]) == top.indices.tolist() and result.top_logprobs[0] is None
    assert list(result.top_logprobs[4].values()) == pytest.approx(logprobs[4].topk(2).values.tolist(), abs=1e-5)
