"""What a radix-cache hit reuses (``OSCAR_PREFIX_REUSE``; docs/SERVING.md, "Prefix reuse"): ``exact``, the default,
the cached prefix's BF16 sink only, so that a hit reads what a cold prefill reads; ``quantized``, every cached page
up to the recent window. What a chunked prefill reads of its own earlier chunks (``OSCAR_PREFILL_STAGE_MIB``;
"Chunked prefill"): their BF16 rows up to that many MiB per request. Names only (no torch, no sglang): the settings,
the plugin, the client and the benchmarks read them."""

ENV_PREFIX_REUSE = "OSCAR_PREFIX_REUSE"
PREFIX_REUSE = ("exact", "quantized")  # the first is the default

ENV_PREFILL_STAGE = "OSCAR_PREFILL_STAGE_MIB"
PREFILL_STAGE_MIB = 2048  # its default (0: off)

__all__ = ["ENV_PREFILL_STAGE", "ENV_PREFIX_REUSE", "PREFILL_STAGE_MIB", "PREFIX_REUSE"]
