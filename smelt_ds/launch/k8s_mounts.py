"""What a pod of the Kubernetes job can see: its mounts, and the recipe paths that lie outside them.

A pod of ``launchers/k8s/pytorchjob.yaml`` runs in the image's copy of the checkout (the working
directory, :data:`smelt_ds.launch.jobs.K8S_WORKDIR` unless ``--workdir``) and sees four places:

- ``WORKDIR/runs``: the ``runs`` volume (a ReadWriteMany PVC, ``--runs-pvc``), shared by every pod
  and read-write: run directories, checkpoints, the token cache (``SMELT_DS_CACHE``);
- ``WORKDIR/corpora``: the ``corpora`` volume (``--data-pvc``), read-only: data and tokenizers;
- :data:`K8S_RECIPE_DIR`: the job's ConfigMap, read-only: the resolved recipe;
- the image's checkout itself, read-only: what the repository ships (recipes, ds_configs, ...);
  ``.dockerignore`` keeps run outputs and corpora out of it;
- ``/dev/shm``: an ``emptyDir`` in memory, the pod's own and empty at start: node-local, so no
  recipe path may lie there.

A path on no shared volume is node-local for the job: every pod (and every restart) would see its
own copy, or nothing.

:func:`unseen_paths` names every recipe path a pod could not open, so that ``render-job`` refuses
the manifest instead of a pod failing after the queue.
"""

from __future__ import annotations

import glob
import posixpath
from dataclasses import dataclass
from pathlib import Path

from smelt_ds.config.run import RunConfig
from smelt_ds.resources import DATA_ROOT

__all__ = ["K8S_RECIPE_DIR", "K8S_RECIPE", "Mount", "pod_mounts", "unseen_paths"]

#: where a pod finds its recipe: the manifest's ConfigMap (key ``recipe.yaml``), mounted read-only
K8S_RECIPE_DIR = "/etc/smelt-ds"
K8S_RECIPE = f"{K8S_RECIPE_DIR}/recipe.yaml"
#: top-level entries of the checkout that the image leaves out (.dockerignore), besides the mounts
_NOT_IN_IMAGE = ("runs", "evals", "exports", "hf", "corpora", "jobs", "site", ".cache", ".git")


@dataclass(frozen=True)
class Mount:
    """One place a pod sees: its path in the pod, what backs it, whether the pod may write there,
    and whether every pod sees the same files there (``shared``: a PVC or ConfigMap)."""

    path: str
    what: str
    writable: bool = False
    shared: bool = True

    def holds(self, path: str) -> bool:
        return path == self.path or path.startswith(self.path.rstrip("/") + "/")


def pod_mounts(workdir: str, runs_pvc: str, data_pvc: str) -> list[Mount]:
    """The volumes of a pod (the checkout of the image last, as the fallback for read paths)."""
    return [Mount(f"{workdir}/runs", f"PVC {runs_pvc}, shared, read-write", True),
            Mount(f"{workdir}/corpora", f"PVC {data_pvc}, read-only"),
            Mount(K8S_RECIPE_DIR, "the job's ConfigMap: the resolved recipe, read-only"),
            Mount("/dev/shm", "emptyDir in memory: this pod's own, empty at start", True, shared=False)]


def _in_pod(path: str, workdir: str) -> str:
    """``path`` as the pod resolves it: relative paths in the working directory."""
    return posixpath.normpath(path if posixpath.isabs(path) else posixpath.join(workdir, path))


def _in_image(path: str, workdir: str) -> bool:
    """Whether ``path`` (absolute, in the pod) is a file the image's checkout ships: under the
    working directory, present in this checkout, and not left out by .dockerignore."""
    if not (path == workdir or path.startswith(workdir.rstrip("/") + "/")):
        return False
    rel = posixpath.relpath(path, workdir)
    if rel.split("/", 1)[0] in _NOT_IN_IMAGE:
        return False
    local = DATA_ROOT / rel
    return bool(glob.glob(str(local))) if glob.has_magic(rel) else local.exists()


def _reads(cfg: RunConfig) -> list[tuple[str, str]]:
    """``(field, path)`` of every file or directory the run reads."""
    out = []
    for i, src in enumerate(cfg.data.sources):
        kind = src.kind()
        if kind in ("path", "megatron", "tokens"):
            out.append((f"data.sources[{i}].{kind}", str(getattr(src, kind))))
    if cfg.data.tokenizer.path:
        out.append(("data.tokenizer.path", str(cfg.data.tokenizer.path)))
    if cfg.train.init_from:
        out.append(("train.init_from", str(cfg.train.init_from)))
    return out


def unseen_paths(cfg: RunConfig, workdir: str, run_dir: str, mounts: list[Mount],
                 env: dict[str, str] | None = None) -> list[str]:
    """One line per recipe path a pod cannot use: a file the run reads that lies on no shared
    mount and is not in the image's checkout; a run directory, data cache (``data.cache_dir``, else
    ``SMELT_DS_CACHE`` of the job's ``env``, ``--env``, which replaces the manifest's) or
    ``data.output_dir`` outside the shared read-write volume (another pod, or the next start, would
    not see what it wrote). ``run_dir``: the run directory as the job names it."""
    bad = []
    for field, path in _reads(cfg):
        where = _in_pod(str(Path(path).expanduser()) if path.startswith("~") else path, workdir)
        local = next((m for m in mounts if m.holds(where) and not m.shared), None)
        if local is not None:
            bad.append(f"`{field}` ({path!r}, {where} in the pod) is on {local.path} ({local.what}): put it on the "
                       "corpora volume and name it corpora/... (relative to the working directory)")
        elif not any(m.holds(where) for m in mounts) and not _in_image(where, workdir):
            bad.append(f"`{field}` ({path!r}, {where} in the pod) is in no volume of the pod and not in the "
                       "image: put it on the corpora volume and name it corpora/... (relative to the working "
                       "directory)")
    shared = [m for m in mounts if m.writable and m.shared]
    cache = ("data.cache_dir", cfg.data.cache_dir)
    if cfg.data.cache_dir is None and "SMELT_DS_CACHE" in (env or {}):  # --env's replaces the manifest's
        cache = ("--env SMELT_DS_CACHE", (env or {})["SMELT_DS_CACHE"])
    writes: list[tuple[str, str | None]] = [("train.run_dir", run_dir), cache,
                                            ("data.output_dir", cfg.data.output_dir),
                                            ("data.ladder_packages_dir", cfg.data.ladder_packages_dir)]
    for field, written in writes:
        if written is None:
            continue
        path, where = written, _in_pod(written, workdir)
        if not any(m.holds(where) for m in shared):
            fix = ("use a run directory under runs/ (the default runs/{name})" if field == "train.run_dir" else
                   f"leave {field} unset (the manifest sets SMELT_DS_CACHE on the runs volume, where every pod "
                   "finds what one prepared) or put it under runs/")
            bad.append(f"`{field}` ({path!r}, {where} in the pod) is not on the shared read-write volume "
                       f"({shared[0].path if shared else 'none'}): {fix}")
    return bad
