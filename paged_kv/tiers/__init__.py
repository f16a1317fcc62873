"""Tiers below the device pool for cached prefix blocks: host memory, then disk (``disk_tier``).

Import the tier modules themselves (``paged_kv.tiers.disk_tier``); this package exports nothing,
so importing it costs nothing.
"""
