"""The disk tier of the prefix cache (``disk_tier``), under the host tier (``paged_kv.host_tier``) and the device pool.

Import the tier modules themselves (``paged_kv.tiers.disk_tier``); this package exports nothing,
so importing it costs nothing.
"""
