"""Cache formats and the caches that store them: the format registry, pages, attention, the torch and device caches."""
