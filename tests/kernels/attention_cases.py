"""Shared helpers of the attention kernel tests (decode, prefill, merge): paged caches and naive truth.

``build_paged`` puts sequences in shuffled physical blocks, shares prefix blocks between
sequences, and fills every slot no sequence owns, every unused block and every padding
table entry's block with NaN, so any stale read shows up as NaN. ``naive_attention`` is
the dense float64 truth (``naive_decode`` and ``naive_prefill`` over a ``Paged`` bundle);
``run_decode`` and ``run_prefill`` call the checked kernels on one; ``build_for_gpu``
compiles the kernels for CUDA without a GPU.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton
from backend_device import call_on_backend

from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.quant import quantize_per_token_head
from paged_kv.errors import PagedKVError

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I8, E4M3, E5M2 = torch.int8, torch.float8_e4m3fn, torch.float8_e5m2
TOL = {F32: 2e-5, F16: 2e-3, BF16: 1.6e-2}  # output rounding of q's dtype, on outputs of size ~1


@dataclass
class Paged:
    """A paged K/V cache plus the dense float64 truth it encodes."""

    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [num_blocks, block_size, Hkv] for quantized caches
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    dense_k: list[torch.Tensor]  # per sequence [L, Hkv, D] float64 (dequantized values)
    dense_v: list[torch.Tensor]
    exact_k: list[torch.Tensor]  # per sequence, the float values before quantization
    exact_v: list[torch.Tensor]
    nan_block: int  # a NaN-filled block id that no sequence owns


def _fill_value(dtype: torch.dtype) -> float:
    """Stale-slot filler: NaN where the dtype has one, else the largest int8 code (its scale is NaN)."""
    return 127 if dtype == I8 else math.nan


def _store(cache, scale, table, data, dtype):
    """Write ``data`` [L, Hkv, D] (float) into the blocks of ``table``; returns the dequantized float64 copy."""
    if scale is not None:
        codes, scales = quantize_per_token_head(data, dtype)
        dense = codes.double() * scales.double()[..., None]
    else:
        codes, scales, dense = data.to(dtype), None, data.to(dtype).double()
    block_size = cache.shape[1]
    for pos in range(data.shape[0]):
        blk, slot = table[pos // block_size], pos % block_size
        cache[blk, slot] = codes[pos]
        if scale is not None:
            scale[blk, slot] = scales[pos]
    return dense


def build_paged(
    seq_lens, *, block_size, num_kv_heads, head_dim, dtype=F32, seed=0, shared_blocks=0, pad_blocks=2
) -> Paged:
    """Random paged caches: shuffled block ids, sequence 1 shares its first ``shared_blocks`` blocks with sequence 0."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in seq_lens]
    shared = min(shared_blocks, *(n // block_size for n in seq_lens[:2])) if len(seq_lens) > 1 else 0
    num_blocks = sum(counts) - shared + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block, tables, used = perm.pop(), [], 0
    for i, count in enumerate(counts):
        own = count - (shared if i == 1 else 0)
        tables.append((tables[0][:shared] if i == 1 else []) + perm[used : used + own])
        used += own
    quantized = dtype in (I8, E4M3, E5M2)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    storage = F32 if quantized else dtype
    caches = [torch.full(shape, _fill_value(dtype), dtype=storage).to(dtype) for _ in range(2)]
    scales = [torch.full(shape[:3], math.nan) if quantized else None for _ in range(2)]
    truth = {"dense_k": [], "dense_v": [], "exact_k": [], "exact_v": []}
    for i, (n, table) in enumerate(zip(seq_lens, tables)):
        for name, cache, scale in (("k", caches[0], scales[0]), ("v", caches[1], scales[1])):
            data = torch.randn(n, num_kv_heads, head_dim, generator=gen)
            if i == 1 and shared:
                data[: shared * block_size] = truth[f"exact_{name}"][0][: shared * block_size].float()
            truth[f"dense_{name}"].append(_store(cache, scale, table, data, dtype))
            truth[f"exact_{name}"].append(data.double())
    max_blocks = max(counts) + pad_blocks
    rows = [t + [nan_block] * (max_blocks - len(t)) for t in tables]  # padding points at NaN
    block_tables = torch.tensor(rows, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return Paged(caches[0], caches[1], scales[0], scales[1], block_tables, lens, nan_block=nan_block, **truth)


@dataclass
class Forked:
    """A paged cache whose sequences come in groups sharing prefix blocks (forked beams / samples)."""

    paged: Paged
    seq_groups: torch.Tensor  # [S] int64 group of each sequence, -1 when it shares nothing
    prefix_lens: torch.Tensor  # [G] int64 shared tokens of each group
    order: list[int]  # batch row of the i-th sequence built (groups are interleaved in the batch)


def build_forked(groups, *, block_size, num_kv_heads, head_dim, dtype=F32, seed=0, pad_blocks=2) -> Forked:
    """Groups ``(prefix_len, [seq_len, ...])``: members share the blocks of their first prefix_len tokens.

    prefix_len is a multiple of block_size below every member's length (0: the members share
    nothing and are ungrouped). Block ids are shuffled, stale slots and padding hold NaN (like
    :func:`build_paged`), and the batch interleaves the groups (a seeded permutation of rows).
    """
    gen = torch.Generator().manual_seed(seed)
    own = [[-(-n // block_size) - p // block_size for n in lens] for p, lens in groups]
    num_blocks = sum(p // block_size + sum(o) for (p, _), o in zip(groups, own)) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    nan_block = perm.pop()
    quantized = dtype in (I8, E4M3, E5M2)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, _fill_value(dtype), dtype=F32 if quantized else dtype).to(dtype) for _ in range(2)]
    scales = [torch.full(shape[:3], math.nan) if quantized else None for _ in range(2)]
    truth = {f"{a}_{n}": [] for a in ("dense", "exact") for n in "kv"}
    tables, seq_groups, prefix_lens, seq_lens = [], [], [], []
    for (prefix, lens), counts in zip(groups, own):
        shared = [perm.pop() for _ in range(prefix // block_size)]
        head = {n: torch.randn(prefix, num_kv_heads, head_dim, generator=gen) for n in "kv"}
        if prefix:
            prefix_lens.append(prefix)
        for n, count in zip(lens, counts):
            table = shared + [perm.pop() for _ in range(count)]
            for name, cache, scale in (("k", caches[0], scales[0]), ("v", caches[1], scales[1])):
                data = torch.cat([head[name], torch.randn(n - prefix, num_kv_heads, head_dim, generator=gen)])
                truth[f"dense_{name}"].append(_store(cache, scale, table, data, dtype))  # same codes in shared blocks
                truth[f"exact_{name}"].append(data.double())
            tables.append(table)
            seq_groups.append(len(prefix_lens) - 1 if prefix else -1)
            seq_lens.append(n)
    order = torch.randperm(len(tables), generator=gen).tolist()  # sequence i sits at batch row order[i]
    inverse = sorted(range(len(order)), key=order.__getitem__)
    max_blocks = max(map(len, tables)) + pad_blocks
    rows = [tables[i] + [nan_block] * (max_blocks - len(tables[i])) for i in inverse]
    truth = {name: [values[i] for i in inverse] for name, values in truth.items()}
    paged = Paged(
        caches[0], caches[1], scales[0], scales[1], torch.tensor(rows, dtype=torch.int32),
        torch.tensor([seq_lens[i] for i in inverse], dtype=torch.int32), nan_block=nan_block, **truth,
    )  # fmt: skip
    groups_t = torch.tensor([seq_groups[i] for i in inverse], dtype=torch.int64)
    return Forked(paged, groups_t, torch.tensor(prefix_lens, dtype=torch.int64), order)


# Compiles, for the CUDA archs in argv[1], every kernel launch that the wrapper calls in argv[2] make:
# catches what the interpreter cannot (types, layouts, constexpr branches) without a GPU, and fails
# when ptxas reports register spills (its -v log, which Triton prints with dump_ptxas_log).
GPU_BUILD_SCRIPT = r"""
import contextlib, io, re, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernels.decode_attention as dec, kernels.prefill_attention as pre, kernels.merge_states as ms
import kernels.prefix_attention as pfx, kernels.cascade_attention as cas, kernels.splits as spl, kernels.checks as chk

TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
         torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64", torch.float8_e5m2: "fp8e5",
         torch.float8_e4m3fn: "fp8e4nv"}
built = []

def signature(fn, args, constexprs):
    # Like the JIT: ints equal to 1 become constants; pointers and 16-divisible ints get the hint.
    sig, consts, attrs = {}, dict(constexprs), {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, args)):
        if isinstance(arg, torch.Tensor):
            sig[name], attrs[(i,)] = "*" + TYPES[arg.dtype], [["tt.divisibility", 16]]
        elif isinstance(arg, float):
            sig[name] = "fp32"
        elif arg == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32" if abs(arg) < 2**31 else "i64"
            if arg % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({name: "constexpr" for name in constexprs})
    return sig, consts, attrs

class Build:
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        def launch(*args, num_warps=4, num_stages=3, **constexprs):
            sig, consts, attrs = signature(self.fn, args, constexprs)
            options = {"num_warps": num_warps, "num_stages": num_stages}
            for arch in sys.argv[1].split(","):
                target = GPUTarget("cuda", int(arch), 32)
                log = io.StringIO()
                with contextlib.redirect_stdout(log):
                    triton.compile(ASTSource(self.fn, sig, consts, attrs), target=target, options=options)
                spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log.getvalue())]
                if not spills:
                    sys.exit(f"no ptxas report for {self.fn.__name__}: {log.getvalue()[-500:]}")
                if max(spills) > 0:
                    sys.exit(f"{self.fn.__name__} spills {max(spills)} bytes on sm{arch} with Triton "
                             f"{triton.__version__}: {constexprs} {options}")
            built.append(self.fn.__name__)
        return launch

for module, name in ((dec, "_decode_split_kernel"), (spl, "_merge_splits_kernel"), (pre, "_prefill_kernel"),
                     (ms, "_merge_kernel"), (pfx, "_prefix_kernel")):
    setattr(module, name, Build(getattr(module, name)))
for module in (ms, chk):
    module.check_triton_device = lambda t: None
exec(sys.argv[2])
print(" ".join(built))
"""


def build_for_gpu(calls: str, archs: str = "80,90") -> list[str]:
    """Compile, for CUDA sm80 and sm90 and without a GPU, the kernels that ``calls`` launch; return their names.

    The check is that of the installed Triton (its ptxas and code generator): a failure names the
    version. Every Triton the project supports (3.6-3.9) built the default tiles without spills.
    """
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton build ships no ptxas")
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v log (registers, spills) to stdout
    env["TRITON_ALWAYS_COMPILE"] = "1"  # a cached kernel would skip ptxas and its log
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    args = [sys.executable, "-c", GPU_BUILD_SCRIPT, archs, calls]
    done = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"Triton {triton.__version__}: {done.stderr[-4000:]}"
    return done.stdout.split()


def naive_attention(q, k, v, q_pos, *, scale, sliding_window=None, soft_cap=None):
    """Dense float64 softmax attention: q [M, Hq, D] at positions q_pos over k/v [L, Hkv, D] -> (out, lse)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    out, lse = torch.zeros(q.shape, dtype=torch.float64), torch.zeros(q.shape[:2], dtype=torch.float64)
    kpos = torch.arange(k.shape[0])
    for h in range(q.shape[1]):
        logits = q[:, h] @ k[:, h // group].T * scale  # [M, L]
        if soft_cap is not None:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        pos = torch.as_tensor(q_pos)[:, None]
        allowed = kpos[None] <= pos
        if sliding_window is not None:
            allowed &= kpos[None] > pos - sliding_window
        logits = logits.masked_fill(~allowed, -math.inf)
        lse[:, h] = torch.logsumexp(logits, -1)
        out[:, h] = torch.softmax(logits, -1) @ v[:, h // group]
    return out, lse


def run_decode(q, paged: Paged, **kwargs):
    """Call paged_decode_attention on a Paged bundle, on the backend's device (results on the CPU)."""
    return call_on_backend(
        paged_decode_attention, q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
        k_scale=paged.k_scale, v_scale=paged.v_scale, **kwargs,
    )  # fmt: skip


def naive_decode(q, paged: Paged, *, exact=False, scale=None, **opts):
    """Naive decode over the dense truth: q [S, Hq, D] -> (out [S, Hq, D], lse [S, Hq]) float64."""
    ks, vs = (paged.exact_k, paged.exact_v) if exact else (paged.dense_k, paged.dense_v)
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    outs = [
        naive_attention(q[s : s + 1], ks[s], vs[s], [ks[s].shape[0] - 1], scale=scale, **opts) for s in range(len(ks))
    ]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


def cu_seqlens(q_lens) -> torch.Tensor:
    """[0, q_len_0, q_len_0 + q_len_1, ...] as int32."""
    return torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)


def naive_prefill(q, paged: Paged, q_lens, *, scale=None, **opts):
    """Naive prefill over the dense truth: packed q [T, Hq, D] -> (out [T, Hq, D], lse [T, Hq]) float64."""
    scale = 1 / math.sqrt(q.shape[2]) if scale is None else scale
    outs, lses, start = [], [], 0
    for s, q_len in enumerate(q_lens):
        length = paged.dense_k[s].shape[0]
        q_pos = list(range(length - q_len, length))
        kv = (paged.dense_k[s], paged.dense_v[s])
        out, lse = naive_attention(q[start : start + q_len], *kv, q_pos, scale=scale, **opts)
        outs.append(out)
        lses.append(lse)
        start += q_len
    return torch.cat(outs), torch.cat(lses)


def run_prefill(q, paged: Paged, q_lens, **kwargs):
    """Call paged_prefill_attention on a Paged bundle, on the backend's device (results on the CPU)."""
    return call_on_backend(
        paged_prefill_attention, q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens,
        cu_seqlens(q_lens), k_scale=paged.k_scale, v_scale=paged.v_scale, **kwargs,
    )  # fmt: skip


def random_q(q_lens, num_heads, head_dim, dtype, seed, gain=1.0):
    """Packed random queries [sum(q_lens), Hq, D]."""
    gen = torch.Generator().manual_seed(seed)
    return (gain * torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)).to(dtype)


def assert_close(actual, expected, tol):
    """Elementwise |a - e| <= tol * (1 + |e|), no NaN anywhere."""
    actual = actual.double()
    assert not torch.isnan(actual).any()
    torch.testing.assert_close(actual, expected.double(), atol=tol, rtol=tol)


def fail_launch(*args, **kwargs):
    """Stand-in for a kernel path that must not run."""
    raise AssertionError("launched despite invalid input")


def assert_rejected(monkeypatch, module, paths, call, inputs, error) -> None:
    """``call(**inputs)``, on the backend's device, raises ``error`` (a PagedKVError) before ``paths`` run."""
    for name in paths:
        monkeypatch.setattr(module, name, fail_launch)
    with pytest.raises(error) as info:
        call_on_backend(call, **inputs)
    assert isinstance(info.value, PagedKVError)
