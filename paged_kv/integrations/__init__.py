"""Integrations with other libraries; each submodule imports its library only when imported itself.

- ``paged_kv.integrations.transformers`` -- ``PagedCache``, a ``transformers.Cache`` on paged storage
  (full-attention and sliding-window layers; needs the ``hf`` extra: ``pip install 'paged-kv[hf]'``).
"""
