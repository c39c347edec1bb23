"""Profiler labels of the plugin's phases: ``torch.profiler.record_function`` ranges named ``oscar.*``.

With ``OSCAR_PROFILE_LABELS=1`` in the environment of SGLang's scheduler process, the attention backend wraps its
phases and its pool's (``install_labels``), so a trace taken there (SGLang's ``Engine.start_profile``; the prefix
sweep's ``profile`` mode) says which phase of an extend or decode step launched each kernel and how long the host
spent in it. Off by default: a range costs a few microseconds of host time per call. The decode step's calls are
left alone (they run inside SGLang's CUDA-graph capture, and a replay records no host ranges anyway); the decode
profile with labels is ``oscar.bench.serving.synthetic.label_ranges``.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

ENV_LABELS = "OSCAR_PROFILE_LABELS"

# attribute -> label; the order is the nesting a trace shows (an extend layer holds its pages, sink, write, fold)
BACKEND_LABELS = {
    "init_forward_metadata": "oscar.metadata",
    "forward_extend": "oscar.extend",
    "_extend_over_pages": "oscar.extend.pages",
    "_to_folded": "oscar.fold",
}
POOL_LABELS = {
    "write": "oscar.extend.write",
    "restore_sink": "oscar.extend.sink",
    "cached_rows": "oscar.extend.dequantize",
    "store_sink": "oscar.tree.store_sink",
    "release_sink_pages": "oscar.tree.release",
}
LABELS = (*BACKEND_LABELS.values(), *POOL_LABELS.values())


def labels_requested(env: Any = None) -> bool:
    """Whether ``OSCAR_PROFILE_LABELS`` asks for the labels (``1``/``true``/``yes``)."""
    return str((os.environ if env is None else env).get(ENV_LABELS, "")).lower() in ("1", "true", "yes")


def _labelled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    from torch.profiler import record_function

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)

    inner._oscar_label = label  # type: ignore[attr-defined]
    return inner


def install_labels(backend: Any) -> list[str]:
    """Wrap the phases of ``backend`` (an ``OscarAttnBackend``) and of its pool, on the instances, in their labels
    (idempotent); returns the labels installed."""
    done = []
    for obj, table in ((backend, BACKEND_LABELS), (getattr(backend, "pool", None), POOL_LABELS)):
        for name, label in table.items():
            fn = getattr(obj, name, None)
            if fn is None or hasattr(fn, "_oscar_label"):
                continue
            setattr(obj, name, _labelled(fn, label))
            done.append(label)
    return done


__all__ = ["BACKEND_LABELS", "ENV_LABELS", "LABELS", "POOL_LABELS", "install_labels", "labels_requested"]
