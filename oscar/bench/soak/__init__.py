"""The soak table (``python -m oscar gpu soak``): the served default under mixed load for minutes (spec.py)."""
