"""The files smelt-ds reads at run time, and where they are: in the checkout or in the installed package.

Three folders of the repository are read by the commands, not only by developers:

* ``ds_configs/*.json``: the DeepSpeed config templates (:func:`smelt_ds.parallel.zero_section.load_template`);
* ``launchers/``: the deepspeed / Slurm / Kubernetes job templates (``smelt-ds render-job``, ``smelt-ds sweep``);
* ``recipes/``: the shipped recipes (``smelt-ds recipes table`` lists them; sweeps name them relatively).

They have one source, the top-level folders of the repository, where users look for them. ``setup.cfg``
maps them into the wheel as ``smelt_ds/_data/{ds_configs,launchers,recipes}`` (``package_dir`` and
``package_data``), so a plain ``pip install .`` (not editable) carries them.

:data:`DATA_ROOT` is the folder holding the three. When ``smelt_ds`` is imported from a checkout
(an editable install, ``PYTHONPATH``, the deepspeed launcher's ``python -m smelt_ds.train`` there)
it is the checkout, so edits to the templates take effect at once; otherwise it is ``_data`` of the
installed package, located with :mod:`importlib.resources`. Both have the same layout, so a path
relative to :data:`DATA_ROOT` (``recipes/xl/smelt.yaml``, ``launchers/slurm/smelt.sbatch``) names
the same file in either, and the files of an installed package are plain files on disk (pip never
installs a wheel zipped).

Only from a checkout (:data:`CHECKOUT` is not None): ``smelt-ds recipes table`` rewriting the
checkout's ``docs/recipes.md`` by default (installed, the default is ``docs/recipes.md`` under the
working directory; ``-o -`` prints the table), the tests (``tests/``) and benchmarks (``bench/``),
and the Kubernetes image (``launchers/k8s/Dockerfile`` builds from the checkout). ``.ci/wheel_check``
builds the wheel and runs the commands from an installed copy outside the repository.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["DATA_FOLDERS", "CHECKOUT", "PACKAGE_DATA", "DATA_ROOT", "DS_CONFIG_DIR", "LAUNCHERS_DIR", "RECIPES_DIR",
           "DOCS_TABLE"]

#: the folders that the wheel carries under ``smelt_ds/_data/``
DATA_FOLDERS = ("ds_configs", "launchers", "recipes")


def _checkout() -> Path | None:
    """The repository root when this ``smelt_ds`` is imported from a checkout, else None."""
    root = Path(__file__).resolve().parents[1]
    if (root / "setup.cfg").is_file() and all((root / d).is_dir() for d in DATA_FOLDERS):
        return root
    return None


#: the repository checkout this ``smelt_ds`` is imported from, or None for an installed package
CHECKOUT: Path | None = _checkout()
#: where the installed package holds the data folders (absent in a checkout)
PACKAGE_DATA = Path(str(files(__package__).joinpath("_data")))
#: the folder holding ``ds_configs/``, ``launchers/`` and ``recipes/``
DATA_ROOT: Path = CHECKOUT if CHECKOUT is not None else PACKAGE_DATA
DS_CONFIG_DIR = DATA_ROOT / "ds_configs"
LAUNCHERS_DIR = DATA_ROOT / "launchers"
RECIPES_DIR = DATA_ROOT / "recipes"
#: default output of ``smelt-ds recipes table``: the checkout's docs, else under the working directory
DOCS_TABLE = (CHECKOUT if CHECKOUT is not None else Path()) / "docs" / "recipes.md"
