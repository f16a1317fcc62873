"""A scheduled step as device inputs: built on the host from Python ints, one host->device copy.

:class:`StepInputBuilder` runs in the driver. It applies the step's block-table changes (the
block manager's journal, carried by the scheduler's output) to persistent rows
(:mod:`scheduler.runner.block_tables`), computes positions, slots and lengths with numpy,
and uploads them in one pinned, non-blocking copy. A decode step whose request
sequences share long prefixes (forks of one request, or requests whose prompts hit the same
cached blocks) also gets a cascade plan (:mod:`scheduler.runner.cascade_plan`), planned from the host
mirror of the tables; its index arrays travel in the same copy. The result, a
:class:`StepInput`, carries prepared attention metadata: nothing downstream reads a
device value back (the model's forward can be captured in a CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kernels.metadata import (
    AttentionMetadata,
    CascadeArrays,
    build_cascade_metadata,
    cascade_host_arrays,
    host_positions,
    host_slot_mapping,
    offsets,
)
from paged_kv.block_manager import CopyOp
from scheduler.core.scheduler_output import SchedulerOutput
from scheduler.model.lora_layers import LoRABatch
from scheduler.runner.block_tables import BlockTables, DeviceRows
from scheduler.runner.cascade_plan import may_share, plan_cascade


@dataclass(frozen=True, kw_only=True, eq=False)
class StepInput:
    """Everything a worker needs for one step: device tensors, prepared metadata and block moves."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # block tables, seq lens, cu_seqlens_q, slot mapping + host sizes
    logits_indices: torch.Tensor  # [R] int64 rows of the packed batch whose logits are returned
    swap_out: list[CopyOp]
    swap_in: list[CopyOp]
    copies: list[CopyOp]
    num_prompt_rows: int = 0  # the last of the R rows: prompt positions scored for prompt log-probabilities
    lora: LoRABatch | None = None  # the tokens of each LoRA adapter slot; None: no adapter in the step
    # [P] int64 rows whose final-norm hidden states embedding requests pool (no logits for them); None: none
    pool_indices: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Packed new tokens."""
        return self.input_ids.shape[0]

    @property
    def num_sampled(self) -> int:
        """Rows of logits the step returns."""
        return self.logits_indices.shape[0]


class Uploader:
    """Host->device copies through a reused pinned buffer (plain tensors when the device is the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = torch.empty(0, dtype=torch.int64)
        self._done: torch.cuda.Event | None = None

    def upload(self, values: np.ndarray) -> torch.Tensor:
        """An int64 device copy of ``values`` (non-blocking on CUDA)."""
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type != "cuda":
            return host.to(self.device)
        if self._done is not None and not self._done.query():
            self._done.synchronize()  # the last copy out of the buffer must finish (the step's sync made it so)
        if self._pinned.numel() < host.numel():
            self._pinned = torch.empty(max(host.numel(), 2 * self._pinned.numel()), dtype=torch.int64).pin_memory()
        staged = self._pinned[: host.numel()]
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        return out


@dataclass(frozen=True, kw_only=True, eq=False)
class StepPayload:
    """A step on the host: what any rank needs to rebuild the same :class:`StepInput` on its own device.

    ``flat`` holds, one after the other (lengths in ``sizes``): token ids, positions, slots,
    sequence lengths, cu_seqlens_q, table rows, logits rows (the sampled sequences' last tokens, then
    the prompt positions scored for prompt log-probabilities, then each drafting sequence's positions that
    verify its drafts, then the ``num_pool_rows`` rows embedding requests pool: no logits), and the block-table updates
    (rows, columns, ids), then a cascade step's index arrays (``cascade.parts()``), then the token rows of each
    LoRA slot in ``lora_slots`` (none when one slot takes every token: ``lora_all``).
    Tensor-parallel workers receive it by broadcast.
    """

    flat: np.ndarray  # [sum(sizes)] int64
    sizes: tuple[int, ...]
    host_seq_lens: np.ndarray  # [S] int64
    host_query_lens: np.ndarray  # [S] int64
    max_seq_len: int
    num_blocks: int  # blocks of the GPU pool (the kernels' bound on block ids)
    table_rows: int  # rows of the persistent block tables (a worker grows its copy to match)
    swap_out: list[CopyOp]
    swap_in: list[CopyOp]
    copies: list[CopyOp]
    cascade: CascadeArrays | None = None  # a decode step attended as cascade (shared prefixes once per group)
    num_prompt_rows: int = 0  # logits rows after the sampled ones: prompt positions scored
    num_pool_rows: int = 0  # the last rows of the logits rows part: pooled rows of embedding requests (no logits)
    lora_slots: tuple[int, ...] = ()  # LoRA slots of the step, each with its token rows at the end of ``flat``
    lora_all: int | None = None  # the one LoRA slot every token of the step goes through (no rows uploaded)
    # tensor parallelism: the adapters the driver placed in slots this step, (slot, folder, fingerprint) each, for the
    # workers to load into the same slots before the step
    lora_loads: tuple[tuple[int, str, str], ...] = ()


class StepMaterializer:
    """Uploads a :class:`StepPayload` and gathers its block tables from persistent device rows."""

    def __init__(self, rows: DeviceRows, device: torch.device, block_size: int) -> None:
        self.rows, self.device, self.block_size = rows, device, block_size
        self._uploader = Uploader(device)

    def materialize(self, p: StepPayload) -> StepInput:
        """The step's device tensors and prepared metadata (one host->device copy)."""
        bs = self.block_size
        self.rows.grow_to(p.table_rows)
        flat = self._uploader.upload(p.flat)
        parts = flat.split(p.sizes)
        lora_t = parts[len(parts) - len(p.lora_slots) :]
        ids_t, pos_t, slots_t, lens_t, cu_t, rows_t, logits_t, u_rows, u_cols, u_ids, *cascade_t = parts[
            : len(parts) - len(p.lora_slots)
        ]
        self.rows.apply_updates(u_rows, u_cols, u_ids)
        pool_t = None
        if p.num_pool_rows:  # the pooled rows follow the logits rows
            logits_t, pool_t = logits_t[: -p.num_pool_rows], logits_t[-p.num_pool_rows :]
        width = max(1, -(-p.max_seq_len // bs))
        meta = AttentionMetadata(
            block_tables=self.rows.table[:, :width].index_select(0, rows_t), seq_lens=lens_t.to(torch.int32),
            cu_seqlens_q=cu_t.to(torch.int32), slot_mapping=slots_t, host_seq_lens=p.host_seq_lens,
            host_query_lens=p.host_query_lens, block_size=bs, num_blocks=p.num_blocks,
            max_seq_len=p.max_seq_len, max_query_len=int(p.host_query_lens.max(initial=0)),
        )  # fmt: skip
        if p.cascade is not None:
            meta = replace(meta, cascade=build_cascade_metadata(p.cascade, cascade_t, meta))
        return StepInput(
            input_ids=ids_t, positions=pos_t, meta=meta, logits_indices=logits_t,
            swap_out=p.swap_out, swap_in=p.swap_in, copies=p.copies, num_prompt_rows=p.num_prompt_rows,
            lora=_lora_batch(p, lora_t), pool_indices=pool_t,
        )  # fmt: skip


def _lora_batch(p: StepPayload, rows: tuple[torch.Tensor, ...]) -> LoRABatch | None:
    """The step's token groups per LoRA slot (None: no adapter in the step)."""
    if p.lora_all is not None:
        return LoRABatch(((p.lora_all, None),))
    return LoRABatch(tuple(zip(p.lora_slots, rows))) if p.lora_slots else None


def lora_rows(token_slots: np.ndarray) -> tuple[tuple[int, ...], list[np.ndarray], int | None]:
    """(slots, their token rows, the slot of every token or None) from each token's slot (-1: the base model)."""
    used = np.unique(token_slots[token_slots >= 0])
    if len(used) == 1 and (token_slots == used[0]).all():
        return (), [], int(used[0])
    return tuple(int(s) for s in used), [np.flatnonzero(token_slots == s) for s in used], None


class StepInputBuilder:
    """Builds each step's :class:`StepInput` from the scheduler's decisions (block tables as it says they changed)."""

    def __init__(
        self, block_size: int, num_blocks: int, device: torch.device, max_blocks_per_seq: int, cascade: bool = False,
        min_saved_tokens: int = 0,
    ) -> None:  # fmt: skip
        self.block_size, self.num_blocks, self.device, self.cascade = block_size, num_blocks, device, cascade
        self.min_saved_tokens = min_saved_tokens  # K/V tokens a cascade step must save (see runner.cascade_plan)
        self.tables = BlockTables(max_blocks_per_seq, num_blocks, device)
        self.materializer = StepMaterializer(self.tables.device_rows, device, block_size)

    def build(self, out: SchedulerOutput, lora_slots: np.ndarray | None = None) -> StepInput:
        """Apply the step's table changes, compute its tensors on the host, upload them in one copy.

        ``lora_slots [S]``: the LoRA slot of each scheduled sequence (-1: none; None: no adapter in the step)."""
        return self.materializer.materialize(self.build_payload(out, lora_slots))

    def build_payload(self, out: SchedulerOutput, lora_slots: np.ndarray | None = None) -> StepPayload:
        """Apply the step's table changes and compute everything the step needs on the host."""
        payload = self._payload(out)
        if lora_slots is None:
            return payload
        slots, rows, every = lora_rows(np.repeat(lora_slots, payload.host_query_lens))  # [T]: a token's slot
        flat = np.concatenate([payload.flat, *rows]) if rows else payload.flat
        return replace(payload, flat=flat, sizes=payload.sizes + tuple(len(r) for r in rows), lora_slots=slots,
                       lora_all=every)  # fmt: skip

    def _payload(self, out: SchedulerOutput) -> StepPayload:
        """The step's payload without LoRA rows."""
        self.tables.apply(out.table_changes)
        items = out.scheduled
        n = len(items)
        computed = np.fromiter((s.start for s in items), np.int64, n)
        new = np.fromiter((s.num_tokens for s in items), np.int64, n)
        seq_lens = computed + new  # [S]
        samples = np.fromiter((s.samples for s in items), bool, n)  # an embedding request never samples
        rows = self.tables.rows([s.seq.seq_id for s in items])
        if out.num_draft_tokens:  # speculative decoding: drafts run after their sequence's new tokens
            return self._pack_drafts(out, rows, computed, new, samples)
        ids = [t for s in items for t in s.seq.token_ids[s.start : s.start + s.num_tokens]]
        cascade = self._plan_cascade(rows, new, seq_lens)
        return self._pack(out, rows, computed, new, seq_lens, samples, ids, cascade)

    def _pack_drafts(self, out: SchedulerOutput, rows, computed, new, samples) -> StepPayload:
        """A step with drafts: each drafting sequence's query is its new token and its drafts (their slots are the
        lookahead slots its table already has); its draft rows follow the sampled and the prompt rows."""
        items = out.scheduled
        drafts = np.fromiter((len(s.drafts) for s in items), np.int64, len(items))  # [S]
        new = new + drafts
        ids = [t for s in items for t in (*s.seq.token_ids[s.start : s.start + s.num_tokens], *s.drafts)]
        return self._pack(out, rows, computed, new, computed + new, samples, ids, None, drafts)

    def _plan_cascade(self, rows, new, seq_lens) -> CascadeArrays | None:
        """The step's cascade arrays when it is a decode step whose sequences share enough blocks, else None."""
        if not self.cascade or len(new) < 2 or (new != 1).any():
            return None
        bs = self.block_size
        if not may_share(self.tables.host, rows, seq_lens, bs, min_saved_tokens=self.min_saved_tokens):
            return None  # one column of the mirror and the lengths: no sharing, or too little to pay
        tables = self.tables.host[rows, : -(-int(seq_lens.max()) // bs)]  # [S, W] host mirror, current for the step
        plan = plan_cascade(tables, seq_lens, bs, min_saved_tokens=self.min_saved_tokens)
        if not plan.pays:
            return None
        return cascade_host_arrays(tables, seq_lens, plan.seq_groups, plan.prefix_lens, bs)

    def _pack(self, out, rows, computed, new, seq_lens, samples, ids, cascade: CascadeArrays | None,
              drafts: np.ndarray | None = None) -> StepPayload:
        """The step's payload. ``drafts [S]``: how many of each sequence's new tokens are drafts (its last ones;
        None: none); the positions that verify them (its query's first ``d``) get logits rows after the others."""
        cu = offsets(new)
        seq_of_token, positions = host_positions(computed, new, cu)  # [T], [T]
        slots = host_slot_mapping(self.tables.host, rows, seq_of_token, positions, self.block_size)
        upd_rows, upd_cols, upd_ids = self.tables.take_updates()
        prompt_rows = [cu[i] + np.arange(s.prompt_positions.start, s.prompt_positions.stop) - s.start
                       for i, s in enumerate(out.scheduled) if s.prompt_positions]  # fmt: skip
        draft_rows = [cu[i] + np.arange(d) for i, d in enumerate(drafts) if d] if drafts is not None else []
        logits_rows = np.concatenate([cu[1:][samples] - 1, *prompt_rows, *draft_rows])
        num_prompt_rows = len(logits_rows) - int(samples.sum()) - sum(len(d) for d in draft_rows)
        pool_rows = [cu[i] + np.asarray(s.pool_offsets, dtype=np.int64) for i, s in enumerate(out.scheduled)
                     if s.pool_offsets]  # fmt: skip
        logits_rows = np.concatenate([logits_rows, *pool_rows])
        parts = [np.asarray(ids, dtype=np.int64), positions, slots, seq_lens, cu, rows, logits_rows,
                 upd_rows, upd_cols, upd_ids, *(cascade.parts() if cascade else [])]  # fmt: skip
        return StepPayload(
            flat=np.concatenate(parts), sizes=tuple(len(p) for p in parts), host_seq_lens=seq_lens,
            host_query_lens=new, max_seq_len=int(seq_lens.max(initial=0)), num_blocks=self.num_blocks,
            table_rows=self.tables.host.shape[0],
            swap_out=out.swap_out, swap_in=out.swap_in, copies=out.copies, cascade=cascade,
            num_prompt_rows=num_prompt_rows, num_pool_rows=sum(len(r) for r in pool_rows),
        )  # fmt: skip
