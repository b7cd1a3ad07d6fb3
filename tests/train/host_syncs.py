"""Counting host reads of tensor values (a GPU's host syncs) on a CPU, by call site.

On a GPU, reading a device tensor's value on the host (``.item()``, ``.tolist()``, ``float()``,
``int()``, ``bool()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``) waits for every kernel queued
before it: a host sync. A CPU run has no device, so :class:`HostReads` counts every such call
made from smelt-ds' own code (the first frame outside torch is under ``smelt_ds/``), keyed
``"<path under smelt_ds>:<function>:<method>"``. Calls made inside DeepSpeed are not counted (not
ours to change). A ``.to(d)`` with a device object is a same-device move, not a read; only the
literal ``"cpu"`` counts."""

from __future__ import annotations

import collections
import traceback

from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """A torch function mode counting host reads from smelt-ds code by site (:attr:`sites`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS or (name == "to" and "cpu" in [a for a in (*args[1:], *kwargs.values())
                                                         if isinstance(a, str)]):
            frames = traceback.extract_stack()[:-1]
            caller = next((f for f in reversed(frames) if "/torch/" not in f.filename), None)
            if caller is not None and "/smelt_ds/" in caller.filename:
                where = caller.filename.split("/smelt_ds/", 1)[1]
                self.sites[f"{where}:{caller.name}:{name}"] += 1
        return func(*args, **kwargs)
