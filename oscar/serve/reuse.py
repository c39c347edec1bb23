"""What a radix-cache hit reuses (``OSCAR_PREFIX_REUSE``; docs/SERVING.md, "Prefix reuse"): ``exact``, the default,
the cached prefix's BF16 sink only, so that a hit reads what a cold prefill reads; ``quantized``, every cached page
up to the recent window. Names only (no torch, no sglang): the settings, the plugin, the client and the benchmarks
read them."""

ENV_PREFIX_REUSE = "OSCAR_PREFIX_REUSE"
PREFIX_REUSE = ("exact", "quantized")  # the first is the default

__all__ = ["ENV_PREFIX_REUSE", "PREFIX_REUSE"]
