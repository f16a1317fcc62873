"""The command line's options of the tiered prefix cache and of KV cache events (vLLM's flag names where vLLM has one),
and the tiers' lines of the main job's summary.

``--kv-offloading-size`` (GiB, vLLM's) sizes the host tier under the device pool and
``--kv-offloading-policy`` says what it stores; ``--kv-disk-dir`` / ``--kv-disk-size`` add the disk
tier under it (kept across restarts), whose directory ``--kv-disk-refresh-interval`` rescans for the
files of other engines sharing it; ``--kv-events-config`` (vLLM's: a JSON object of
:class:`KVEventsConfig` fields) or its short form ``--kv-events-endpoint`` publish KV cache events.
A bad value is an argparse error naming the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from paged_kv.config import DISK_REFRESH_INTERVAL_S, HOST_STORE_POLICIES, check_refresh_interval
from paged_kv.errors import InvalidArgumentError, PagedKVError, describe
from scheduler.core.kv_events_config import KVEventsConfig
from scheduler.engine.llm_engine import LLMEngine

GIB = 1 << 30
MIB = 1 << 20


def add_tier_options(p: argparse.ArgumentParser) -> None:
    """The tier and KV-event flags, in their own group of ``--help``."""
    g = p.add_argument_group("tiered prefix cache and KV events")
    g.add_argument("--kv-offloading-size", type=gib, default=0, metavar="GiB",
                   help="host-memory tier of the prefix cache under the device pool, in GiB (default 0: none)")
    g.add_argument("--kv-offloading-policy", choices=HOST_STORE_POLICIES, default="evict",
                   help="what the host tier stores: blocks evicted from the device (evict), "
                        "or every full block as it is written (write); default evict")
    g.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="disk tier under the host tier: block files in DIR, found again after a restart "
                        "(needs --kv-offloading-size and --kv-disk-size)")
    g.add_argument("--kv-disk-size", type=gib, default=0, metavar="GiB",
                   help="the disk tier's budget in GiB (default 0; > 0 with --kv-disk-dir)")
    g.add_argument("--kv-disk-refresh-interval", type=seconds, default=DISK_REFRESH_INTERVAL_S, metavar="SECONDS",
                   help="rescan --kv-disk-dir every SECONDS in the background, to find the blocks other engines "
                        f"sharing it write (default {DISK_REFRESH_INTERVAL_S}; 0: only at start-up)")
    g.add_argument("--kv-events-config", type=kv_events_json, default=None, metavar="JSON",
                   help='KV cache events, vLLM\'s KVEventsConfig as JSON, e.g. '
                        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'')
    g.add_argument("--kv-events-endpoint", type=zmq_endpoint, default=None, metavar="ADDR",
                   help="publish KV cache events on this ZeroMQ address (tcp://..., ipc://...); "
                        "overrides the endpoint of --kv-events-config")  # fmt: skip


def gib(text: str) -> int:
    """A size in GiB (a float, as vLLM's) as bytes; argparse's error on anything but a finite size >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size in GiB >= 0 (a number, 0.5 is 512 MiB)")
    return round(value * GIB)


def seconds(text: str) -> float:
    """``--kv-disk-refresh-interval``: seconds (a finite number >= 0); argparse's error otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    try:
        return check_refresh_interval("--kv-disk-refresh-interval", value) or 0.0
    except PagedKVError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def kv_events_json(text: str) -> KVEventsConfig:
    """``--kv-events-config``: a JSON object of KVEventsConfig fields; argparse's error naming what is wrong."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object ({e})") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object of KVEventsConfig fields")
    known = [f.name for f in dataclasses.fields(KVEventsConfig)]
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown field(s) {unknown}: expected fields among {known}")
    try:
        return KVEventsConfig(**fields)
    except PagedKVError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def zmq_endpoint(text: str) -> str:
    """``--kv-events-endpoint``: a ZeroMQ address KVEventsConfig accepts."""
    try:
        return KVEventsConfig(endpoint=text).endpoint
    except PagedKVError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def tier_fields(args: argparse.Namespace) -> dict[str, object]:
    """CacheConfig's tier fields from the flags; InvalidArgumentError naming the flag when they do not go together."""
    host, disk_dir, disk = args.kv_offloading_size, args.kv_disk_dir, args.kv_disk_size
    if disk_dir is not None and not disk:
        raise InvalidArgumentError(describe("--kv-disk-size", 0, "a size in GiB > 0 with --kv-disk-dir"))
    if disk and disk_dir is None:
        raise InvalidArgumentError(describe("--kv-disk-dir", None, "a directory with --kv-disk-size"))
    if disk_dir is not None and not host:
        expected = "a size in GiB > 0 with --kv-disk-dir (disk reads land in the host tier)"
        raise InvalidArgumentError(describe("--kv-offloading-size", 0, expected))
    if host and args.no_prefix_caching:
        raise InvalidArgumentError(describe("--kv-offloading-size", host / GIB, "0 with --no-prefix-caching "
                                            "(the tiers hold cached blocks)"))  # fmt: skip
    return dict(kv_offloading_bytes=host, host_store=args.kv_offloading_policy, kv_disk_dir=disk_dir,
                kv_disk_bytes=disk, kv_disk_refresh_interval_s=args.kv_disk_refresh_interval)  # fmt: skip


def kv_events(args: argparse.Namespace) -> KVEventsConfig | None:
    """The KV events configuration of the flags: ``--kv-events-config``, enabled at ``--kv-events-endpoint``."""
    config = args.kv_events_config
    if args.kv_events_endpoint is None:
        return config
    base = config if config is not None else KVEventsConfig()
    return dataclasses.replace(base, enable_kv_cache_events=True, endpoint=args.kv_events_endpoint)


def tier_summary(engine: LLMEngine) -> str | None:
    """The tiers' lines of a run's summary: hits by tier, bytes moved, occupancy (None without a host tier)."""
    if engine.tiers is None:
        return None
    stats = engine.block_manager.stats()
    t = engine.tiers.stats(stats)
    device = stats.num_hit_tokens - t.host_hit_tokens - t.disk_hit_tokens
    hits = [f"device {device} tokens", f"host {t.host_hit_tokens}"]
    moved = [f"device->host {_mib(t.bytes_stored)}, host->device {_mib(t.bytes_loaded)}"]
    cached = _share(t.host_cached_blocks, t.host_blocks)
    held = [f"host {t.host_cached_blocks} of {t.host_blocks} blocks cached ({cached})"]
    if t.disk_capacity_bytes:
        hits.append(f"disk {t.disk_hit_tokens}")
        moved.append(f"disk written {_mib(t.disk_bytes_written)}, read {_mib(t.disk_bytes_read)}")
        used = _share(t.disk_bytes_used, t.disk_capacity_bytes)
        held.append(f"disk {_mib(t.disk_bytes_used)} of {_mib(t.disk_capacity_bytes)} ({used})")
    return "\n".join((f"prefix-cache hits by tier: {', '.join(hits)}", f"tier traffic: {'; '.join(moved)}",
                      f"tier occupancy: {'; '.join(held)}"))


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "0%"
