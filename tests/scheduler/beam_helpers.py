"""Beam-search checks shared by the scheduler tests: transformers' beams as the reference, and their comparison."""

from __future__ import annotations

import pytest
import torch

WIDTH = 4
NEW = 16


def hf_beams(hf_model, prompt, *, width=WIDTH, new=NEW, eos=None, **kwargs):
    """transformers' ``width`` best hypotheses (tokens cut after EOS), their scores, and its number of steps."""
    calls = []
    hook = hf_model.register_forward_hook(lambda *_: calls.append(1))
    ids = torch.tensor([prompt])
    out = hf_model.generate(  # an explicit mask: a prompt token equal to pad_token_id is not padding
        ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width, num_return_sequences=width,
        max_new_tokens=new, eos_token_id=eos, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
        **kwargs,
    )  # fmt: skip
    hook.remove()
    seqs = [row[len(prompt) :].tolist() for row in out.sequences]
    stops = [eos] if isinstance(eos, int) else eos or []
    seqs = [s[: next((i + 1 for i, t in enumerate(s) if t in stops), len(s))] for s in seqs]
    return seqs, out.sequences_scores.tolist(), len(calls)


def assert_same_beams(output, ref_seqs, ref_scores, ref_steps):
    """Every hypothesis, in rank order, has transformers' tokens and (float32-close) score; it stopped as early."""
    assert [h.token_ids for h in output.hypotheses] == ref_seqs
    assert [h.score for h in output.hypotheses] == pytest.approx(ref_scores, rel=1e-5, abs=1e-5)
    assert output.num_steps == ref_steps
