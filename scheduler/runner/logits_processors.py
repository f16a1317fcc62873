"""Logits controls of a batch of rows, on the device: allowed ids, bad words, min_tokens, logit bias, penalties, min-p.

They run as vLLM runs them, in its order, on the raw logits before temperature: the
additive ones in two launches for the whole batch (an ``index_add_`` that blocks what
``allowed_token_ids`` leaves out, and one ``index_put_(accumulate=True)`` that adds ``-inf``
at every (row, token) blocked by a bad word or by ``min_tokens`` and each logit bias), then
the penalties on the rows that have them (repetition, frequency, presence: a few vectorized
ops over those rows). Min-p comes after temperature (see the sampler). :func:`plan_controls`
decides everything on the host from Python values: which rows, which pairs, which values,
and uploads them in one copy per dtype; no device value is ever read back, and a step whose
rows use no control builds nothing (None).

Penalties need each sequence's token counts on the device. :class:`PenaltyCounts` keeps
them per sequence across steps, in a slot row, updated with the sampled tokens on the
device; a slot is rebuilt from the host's token lists when it is new or out of step.

Draft verification (speculative decoding) plans its rows with ``pending``: row ``j`` of a drafting
sequence is its sequence's history followed by its ``j`` first drafts, so every control sees the
outputs it would see at that position without drafts. The rows of one sequence share its slot; the
pending drafts are added to the gathered counts of each row on the device, never to the slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from scheduler.core.params import FLOAT32_MAX, SamplingParams

NEG_INF = float("-inf")


class TokenHistory(Protocol):
    """What the controls read of a sampled sequence (a :class:`~scheduler.core.sequence.Sequence` is one)."""

    seq_id: int
    token_ids: list[int]  # prompt, then outputs
    prompt_len: int


@dataclass(frozen=True)
class _History:
    """A stand-in history: a row sampled with no sequence behind it (an empty output)."""

    seq_id: int
    token_ids: list[int]
    prompt_len: int


def empty_histories(n: int) -> list[TokenHistory]:
    """``n`` histories with no tokens, one per row (ids ``-1, -2, ...``: never kept in penalty slots)."""
    return [_History(-1 - i, [], 0) for i in range(n)]


def uses_penalties(p: SamplingParams) -> bool:
    """Whether a row's parameters penalize repeated tokens."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def uses_controls(p: SamplingParams) -> bool:
    """Whether a row's parameters change its logits before temperature (else it pays nothing here)."""
    return bool(p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids or p.min_tokens) or uses_penalties(p)


def upload(device: torch.device, arrays: Sequence[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
    """``arrays`` on ``device`` as ``dtype`` in one host->device copy (views of one flat tensor)."""
    np_dtype = np.int64 if dtype == torch.int64 else np.float32
    flat = np.concatenate([np.asarray(a, dtype=np_dtype).reshape(-1) for a in arrays]) if arrays else np.empty(0)
    host = torch.from_numpy(np.ascontiguousarray(flat, dtype=np_dtype))
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split([int(np.size(a)) for a in arrays]))


class PenaltyCounts:
    """Per-sequence token counts on the device, one slot row per penalized sequence, kept across steps.

    ``counts[k, t]``: occurrences of token t among the outputs of the sequence in slot k;
    ``in_prompt[k, t]``: whether t occurs in its prompt (column ``vocab`` takes padding).
    Invariant: a slot holds the counts of its sequence's first ``counted[k]`` outputs; it is
    used for a step only when that equals the sequence's output count now (outputs only grow
    by appended tokens, so equal counts mean equal tokens), else it is rebuilt from the host
    token lists (a new or forked sequence, or one whose last step failed half-way).
    :meth:`record` adds each step's sampled tokens on the device and counts them on the host
    (the engine appends exactly the tokens it samples). Slots not used by the current step
    are reused least recently used first; the rows grow when a step needs more.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size + 1, dtype=torch.float32, device=device)  # [slots, V + 1]
        self.in_prompt = torch.zeros(0, vocab_size + 1, dtype=torch.bool, device=device)  # [slots, V + 1]
        self._slot_of: dict[int, int] = {}  # seq_id -> slot
        self._owner: list[int | None] = []  # slot -> seq_id
        self._counted: list[int] = []  # slot -> outputs its row counts
        self._last_step: list[int] = []  # slot -> step that last used it
        self._step = 0

    @property
    def num_slots(self) -> int:
        """Slot rows allocated."""
        return len(self._owner)

    def slot_of(self, seq_id: int) -> int | None:
        """The slot holding ``seq_id``'s counts, if any."""
        return self._slot_of.get(seq_id)

    def assign(self, histories: Sequence[TokenHistory]) -> tuple[list[int], list[int]]:
        """Slots of a step's penalized sequences, and the indices (into ``histories``) of those to rebuild."""
        self._step += 1
        slots, stale = [], []
        for i, h in enumerate(histories):
            k = self._slot_of.get(h.seq_id) if h.seq_id >= 0 else None
            if k is None or self._counted[k] != len(h.token_ids) - h.prompt_len:
                k = self._take(h.seq_id) if k is None else k
                stale.append(i)
            self._last_step[k] = self._step
            slots.append(k)
        return slots, stale

    def _take(self, seq_id: int) -> int:
        """A slot for ``seq_id``: a free one, else the least recently used one not in this step, else a new row."""
        idle = [k for k, step in enumerate(self._last_step) if step != self._step]
        if not idle:
            idle = list(range(self.num_slots, self.num_slots + max(1, self.num_slots)))
            self._grow(len(idle))
        k = min(idle, key=lambda j: (self._owner[j] is not None, self._last_step[j]))
        self._slot_of.pop(self._owner[k], None)
        self._owner[k] = seq_id
        if seq_id >= 0:
            self._slot_of[seq_id] = k
        return k

    def _grow(self, extra: int) -> None:
        """Add ``extra`` free slot rows (a reallocation: rare, the rows double)."""
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab_size + 1)])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(extra, self.vocab_size + 1)])
        self._owner += [None] * extra
        self._counted += [0] * extra
        self._last_step += [0] * extra

    def rebuild_pairs(self, slots: list[int], histories: Sequence[TokenHistory]) -> tuple[np.ndarray, ...]:
        """Host arrays that rebuild ``slots`` from ``histories`` (valid once :meth:`rebuild` has run).

        The slots, then (slot, token) pairs of the outputs and of the prompts.
        """
        out_ids = [h.token_ids[h.prompt_len :] for h in histories]
        prompt_ids = [h.token_ids[: h.prompt_len] for h in histories]
        for k in slots:
            self._counted[k] = -1
        return (
            np.asarray(slots, dtype=np.int64),
            np.repeat(np.asarray(slots, dtype=np.int64), [len(t) for t in out_ids]),
            np.fromiter((t for ids in out_ids for t in ids), np.int64),
            np.repeat(np.asarray(slots, dtype=np.int64), [len(t) for t in prompt_ids]),
            np.fromiter((t for ids in prompt_ids for t in ids), np.int64),
        )

    def rebuild(self, counted: list[tuple[int, int]], slots, out_slots, out_ids, prompt_slots, prompt_ids) -> None:
        """Zero ``slots`` and count the uploaded pairs into them (device); then mark each ``(slot, outputs)``.

        ``counted`` tells the host how many outputs each rebuilt slot now counts.
        """
        self.counts.index_fill_(0, slots, 0.0)
        self.in_prompt.index_fill_(0, slots, False)
        self.counts.index_put_((out_slots, out_ids), torch.ones_like(out_ids, dtype=torch.float32), accumulate=True)
        self.in_prompt.index_put_((prompt_slots, prompt_ids), torch.ones_like(prompt_ids, dtype=torch.bool))
        self.set_counted(counted)

    def record(self, slots: list[int], slots_t: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one sampled token per slot: ``tokens [n]`` on the device, ``slots`` on the host and device."""
        self.counts.index_put_((slots_t, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)
        for k in slots:
            self._counted[k] += 1

    def record_kept(self, slots: list[int], slots_t: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor) -> None:
        """Count ``tokens [n]`` where ``kept [n]`` (device) into ``slots_t [n]``; the host learns how many later
        (:meth:`set_counted`): until then the slots count as out of step (rebuilt if it never comes)."""
        self.counts.index_put_((slots_t, tokens), kept.float(), accumulate=True)
        for k in slots:
            self._counted[k] = -1

    def set_counted(self, counted: list[tuple[int, int]]) -> None:
        """Each ``(slot, outputs)``: the slot now holds the counts of its sequence's first ``outputs`` outputs."""
        for k, n in counted:
            self._counted[k] = n


@dataclass(frozen=True, eq=False)
class Controls:
    """One step's controls, uploaded: index and value tensors (device) and host flags of what to run."""

    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows [A], (pair row in A, token) [P], [P]
    additive: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, tokens, values [Q]: -inf or a bias
    penalized: torch.Tensor | None  # [N] logits rows with penalties
    slots: list[int]  # their PenaltyCounts slots (host)
    slots_t: torch.Tensor | None  # [N]
    penalties: torch.Tensor | None  # [N, 3] repetition, frequency, presence
    rebuild: tuple | None  # PenaltyCounts.rebuild's arguments: (slot, outputs) pairs, then the uploaded tensors
    use_repetition: bool
    use_frequency: bool  # frequency or presence
    pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (index in penalized, token) [M]: drafts before rows

    def apply(self, logits: torch.Tensor, counts: PenaltyCounts) -> torch.Tensor:
        """Apply every control to ``logits [R, V]`` in place (vLLM's order); return it."""
        if self.allowed is not None:
            rows, pair_rows, tokens = self.allowed
            blocked = torch.full((rows.shape[0], logits.shape[1]), NEG_INF, device=logits.device)  # [A, V]
            blocked[pair_rows, tokens] = 0.0
            logits.index_add_(0, rows, blocked)
        if self.additive is not None:
            logits.index_put_(self.additive[:2], self.additive[2], accumulate=True)  # -inf + b = -inf
        if self.penalized is not None:
            if self.rebuild is not None:
                counts.rebuild(*self.rebuild)
            rows, slots = self.penalized, self.slots_t
            in_prompt = counts.in_prompt.index_select(0, slots) if self.use_repetition else None
            row_counts = counts.counts.index_select(0, slots)  # [N, V + 1]
            if self.pending is not None:  # a draft row: the drafts before it count as outputs
                row_counts.index_put_(self.pending, torch.ones_like(self.pending[1], dtype=torch.float32),
                                      accumulate=True)  # fmt: skip
            penalized = apply_penalties(
                logits.index_select(0, rows), row_counts, in_prompt, self.penalties,
                repetition=self.use_repetition, frequency=self.use_frequency,
            )  # fmt: skip
            logits.index_copy_(0, rows, penalized)
        return logits


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor | None, penalties: torch.Tensor, *,
    repetition: bool = True, frequency: bool = True,
) -> torch.Tensor:  # fmt: skip
    """Penalized ``logits [N, V]``: repetition over prompt and output tokens, then frequency and presence.

    ``counts [N, >= V]`` output occurrences, ``in_prompt [N, >= V]``, ``penalties [N, 3]``
    (repetition, frequency, presence). Repetition divides a positive logit by the penalty and
    multiplies a negative one (transformers, vLLM); frequency subtracts ``f * count``,
    presence ``p`` once (OpenAI). The result is clamped below float32's max (a tiny
    repetition penalty cannot make an infinite logit).
    """
    vocab = logits.shape[1]
    counts = counts[:, :vocab]
    in_output = counts > 0
    if repetition:
        rep = penalties[:, 0:1]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(in_prompt[:, :vocab] | in_output, penalized, logits)
    if frequency:
        logits = logits - penalties[:, 1:2] * counts - penalties[:, 2:3] * in_output
    return logits.clamp_(max=FLOAT32_MAX)


def apply_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Block tokens less likely than ``min_p`` times the row's most likely one: ``scaled [R, V]`` has max 0 per row.

    With the row maximum at 0, ``p_i < min_p * p_max`` is ``scaled_i < log(min_p)`` (min_p 0: nothing blocked).
    """
    return scaled.masked_fill_(scaled < min_p.log()[:, None], NEG_INF)


def blocked_pairs(
    params: Sequence[SamplingParams], histories: Sequence[TokenHistory], eos_token_ids: frozenset[int], vocab: int,
    pending: Sequence[Sequence[int]] | None = None,
) -> tuple[list[int], list[int]]:  # fmt: skip
    """(row, token) pairs to block: bad words' last ids and, before ``min_tokens`` outputs, EOS and stop ids.

    vLLM's rules: a bad word's last id is blocked where the output ends with the rest of the
    word (the prompt is not matched); ids outside the vocabulary can never be sampled anyway.
    ``pending[i]``: tokens that follow row i's history (its drafts before it), outputs like the others.
    """
    rows: list[int] = []
    tokens: list[int] = []
    for i, (p, h) in enumerate(zip(params, histories)):
        extra = pending[i] if pending is not None else ()
        num_out = len(h.token_ids) - h.prompt_len + len(extra)
        for word in p.bad_words_token_ids:
            k = len(word) - 1
            if k <= num_out and (k == 0 or _tail(h.token_ids, extra, k) == list(word[:k])):
                rows.append(i)
                tokens.append(word[-1])
        if num_out < p.min_tokens:
            stops = [t for t in {*p.stop_token_ids, *eos_token_ids} if t < vocab]
            rows += [i] * len(stops)
            tokens += stops
    return rows, tokens


def _tail(token_ids: list[int], extra: Sequence[int], k: int) -> list[int]:
    """The last ``k`` tokens of ``token_ids`` followed by ``extra`` (``k`` at most their total length)."""
    if k <= len(extra):
        return list(extra[len(extra) - k :])
    return token_ids[len(token_ids) - (k - len(extra)) :] + list(extra)


def plan_controls(
    params: Sequence[SamplingParams], histories: Sequence[TokenHistory], counts: PenaltyCounts,
    eos_token_ids: frozenset[int] = frozenset(), pending: Sequence[Sequence[int]] | None = None,
) -> Controls | None:  # fmt: skip
    """The controls of a step's rows (None when no row uses any), built on the host and uploaded: one copy per dtype.

    ``pending`` (draft verification): per row, the tokens after its history (its drafts before it); rows of one
    sequence (one ``seq_id``) then share its penalty slot, and their pending tokens are counted per row.
    """
    if not any(uses_controls(p) for p in params):
        return None
    vocab = counts.vocab_size
    a_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    a_pairs = [(j, t) for j, i in enumerate(a_rows) for t in params[i].allowed_token_ids]
    m_rows, m_tokens = blocked_pairs(params, histories, eos_token_ids, vocab, pending)
    bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    pen = [i for i, p in enumerate(params) if uses_penalties(p)]
    pen_hist = [histories[i] for i in pen]
    assign = counts.assign if pending is None else lambda hs: _shared_slots(hs, counts)
    slots, stale = assign(pen_hist) if pen else ([], [])
    stale_hist = [pen_hist[j] for j in stale]
    rebuild = counts.rebuild_pairs([slots[j] for j in stale], stale_hist) if stale else ()
    counted = [(slots[j], len(h.token_ids) - h.prompt_len) for j, h in zip(stale, stale_hist)]
    drafted = [(j, t) for j, i in enumerate(pen) for t in pending[i]] if pending is not None else []
    ints = [
        a_rows, [j for j, _ in a_pairs], [t for _, t in a_pairs],
        m_rows + [i for i, _, _ in bias], m_tokens + [t for _, t, _ in bias], pen, slots, *rebuild,
        *([[j for j, _ in drafted], [t for _, t in drafted]] if drafted else []),
    ]  # fmt: skip
    floats = [
        [NEG_INF] * len(m_rows) + [b for _, _, b in bias],
        [[params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty] for i in pen],
    ]
    (a_r, a_j, a_t, q_r, q_t, pen_t, slots_t, *rest), (q_v, pen_v) = (
        upload(counts.device, ints, torch.int64), upload(counts.device, floats, torch.float32),
    )  # fmt: skip
    use_rep = any(params[i].repetition_penalty != 1.0 for i in pen)
    use_freq = any(params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0 for i in pen)
    return Controls(
        allowed=(a_r, a_j, a_t) if a_rows else None, additive=(q_r, q_t, q_v) if ints[3] else None,
        penalized=pen_t if pen else None, slots=slots, slots_t=slots_t, penalties=pen_v.view(-1, 3),
        rebuild=(counted, *rest[: len(rebuild)]) if stale else None, use_repetition=use_rep,
        use_frequency=use_freq, pending=tuple(rest[len(rebuild) :]) if drafted else None,
    )  # fmt: skip


def _shared_slots(histories: Sequence[TokenHistory], counts: PenaltyCounts) -> tuple[list[int], list[int]]:
    """:meth:`PenaltyCounts.assign` for rows where a sequence may come several times: one slot per sequence, each
    rebuilt at most once (the indices to rebuild are of its first row)."""
    first: dict[int, int] = {}  # seq_id -> index of its first row
    for j, h in enumerate(histories):
        first.setdefault(h.seq_id, j)
    unique = sorted(first.values())
    slots, stale = counts.assign([histories[j] for j in unique])
    slot_of = {histories[j].seq_id: k for j, k in zip(unique, slots)}
    return [slot_of[h.seq_id] for h in histories], [unique[j] for j in stale]


def processed_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory],
    eos_token_ids: frozenset[int] = frozenset(),
) -> torch.Tensor:  # fmt: skip
    """A copy of ``logits [R, V]`` after every control of its rows, once (penalty counts built from ``histories``)."""
    counts = PenaltyCounts(logits.shape[-1], logits.device)
    controls = plan_controls(params, histories, counts, eos_token_ids)
    return logits.clone() if controls is None else controls.apply(logits.clone(), counts)
