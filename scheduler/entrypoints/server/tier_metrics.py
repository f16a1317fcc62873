"""The tiered prefix cache's series of ``/metrics``: vLLM's names for its CPU offloading, ``paged_kv:`` for the rest.

vLLM counts the hits of its offloading connector as ``vllm:external_prefix_cache_*`` (and
``vllm:prefix_cache_hits`` as the device's alone) and the bytes it moves as
``vllm:kv_offload_store_bytes`` / ``vllm:kv_offload_load_bytes`` (and, its deprecated form still
emitted, ``vllm:kv_offload_total_bytes{transfer_type}``); those keep vLLM's names and meanings.
vLLM names no disk tier's traffic, no hit split by tier and no residency of its CPU tier (its
``kv_offload_cpu_cache_usage_perc`` counts the blocks transfers in flight hold): those are
``paged_kv:`` series. Read from the snapshot the engine thread publishes; a scrape costs the engine nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from scheduler.engine.kv_events import MEDIUM_CPU, MEDIUM_STORAGE
from scheduler.engine.tiered_cache import TierStats

LABELS = ("model_name", "engine")  # vLLM's labels of its series


def tier_families(t: TierStats, hits: dict[str, int], queries: int, labels: tuple[str, str]) -> Iterator[Metric]:
    """The tier series: ``t`` the tiers' figures, ``hits`` the hit tokens by medium, ``queries`` the prompt tokens
    looked up, ``labels`` the values of vLLM's labels."""
    for name, doc, value in (
        ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the prefix cache's lower tiers.",
         queries),
        ("vllm:external_prefix_cache_hits", "Prompt tokens found in the lower tiers (host, disk), loaded to the "
         "device.", hits[MEDIUM_CPU] + hits[MEDIUM_STORAGE]),
        ("vllm:kv_offload_store_bytes", "Bytes stored from the device to the host tier.", t.bytes_stored),
        ("vllm:kv_offload_load_bytes", "Bytes loaded from the host tier to the device.", t.bytes_loaded),
    ):  # fmt: skip
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(labels, value)
        yield family
    moved = CounterMetricFamily("vllm:kv_offload_total_bytes", "Bytes moved between the device and the host tier "
                                "(vLLM's deprecated form).", labels=(*LABELS, "transfer_type"))  # fmt: skip
    for transfer, value in (("GPU_to_CPU", t.bytes_stored), ("CPU_to_GPU", t.bytes_loaded)):
        moved.add_metric([*labels, transfer], value)
    yield moved
    by_medium = CounterMetricFamily("paged_kv:prefix_cache_hits_by_medium", "Prompt tokens found in the prefix "
                                    "cache, by the tier that held them.", labels=("medium",))  # fmt: skip
    for medium, value in hits.items():
        by_medium.add_metric([medium], value)
    yield by_medium
    yield GaugeMetricFamily("paged_kv:kv_offload_cpu_blocks", "Blocks of the host tier.", value=t.host_blocks)
    yield GaugeMetricFamily("paged_kv:kv_offload_cpu_cached_blocks", "Host-tier blocks holding a cached block.",
                            value=t.host_cached_blocks)  # fmt: skip
    if t.disk_capacity_bytes:
        yield from _disk_families(t)


def _disk_families(t: TierStats) -> Iterator[Metric]:
    """The disk tier's traffic and occupancy."""
    for kind, name, doc, value in (
        (CounterMetricFamily, "paged_kv:kv_disk_write_bytes", "Bytes written to the disk tier.", t.disk_bytes_written),
        (CounterMetricFamily, "paged_kv:kv_disk_read_bytes", "Bytes read from the disk tier.", t.disk_bytes_read),
        (GaugeMetricFamily, "paged_kv:kv_disk_used_bytes", "Bytes of block files on the disk tier.", t.disk_bytes_used),
        (GaugeMetricFamily, "paged_kv:kv_disk_capacity_bytes", "The disk tier's byte budget.", t.disk_capacity_bytes),
        (GaugeMetricFamily, "paged_kv:kv_disk_reads_in_flight", "Waiting sequences whose cached blocks are being "
         "read from the disk tier.", t.disk_reads_in_flight),
    ):  # fmt: skip
        yield kind(name, doc, value=value)
