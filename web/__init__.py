"""The web toolkit shared by ``proxy`` and ``dashboard`` (below both, so neither reaches
into the other): OpenAI-shaped errors (:mod:`web.errors`), which paths are the proxy's and
which answer in JSON (:mod:`web.paths`), the cross-site rule (:mod:`web.access`)."""
