"""The wheel carries every subpackage and the data folders that the commands read (setup.cfg).

setup.cfg lists the packages (``find:`` cannot map the top-level ``ds_configs/``, ``launchers/`` and
``recipes/`` into ``smelt_ds/_data``), so a new subpackage must be added there by hand; these tests
fail when one is missing or a data file falls outside ``package_data``. ``.ci/wheel_check`` builds the
wheel itself and runs the commands from it outside the repository.
"""

from __future__ import annotations

import configparser
import fnmatch
from pathlib import Path

from smelt_ds import resources

REPO_ROOT = Path(__file__).resolve().parents[1]


def _options() -> configparser.SectionProxy:
    cp = configparser.ConfigParser()
    cp.read(REPO_ROOT / "setup.cfg")
    return cp


def _lines(value: str) -> list[str]:
    return [v.strip() for v in value.strip().splitlines() if v.strip()]


def _package_dir() -> dict[str, str]:
    out = {}
    for line in _lines(_options()["options"]["package_dir"]):
        name, _, folder = line.partition("=")
        out[name.strip()] = folder.strip()
    return out


def test_setup_cfg_lists_every_subpackage():
    listed = set(_lines(_options()["options"]["packages"]))
    on_disk = {".".join(p.parent.relative_to(REPO_ROOT).parts) for p in (REPO_ROOT / "smelt_ds").rglob("__init__.py")}
    missing = sorted(on_disk - listed)
    assert not missing, f"add {missing} to `packages` in setup.cfg (the wheel would lack them)"
    assert listed - on_disk == set(_package_dir()), "setup.cfg lists packages that do not exist"


def test_package_data_covers_the_data_folders():
    cp = _options()
    mapping = _package_dir()
    assert set(mapping.values()) == set(resources.DATA_FOLDERS)
    for package, folder in mapping.items():
        assert package == f"smelt_ds._data.{folder}", "resources.PACKAGE_DATA expects smelt_ds/_data/<folder>"
        globs = [g.strip() for g in cp["options.package_data"][package].split(",")]
        files = [p.relative_to(REPO_ROOT / folder).as_posix() for p in (REPO_ROOT / folder).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts]
        assert files, folder
        # setuptools globs package_data like glob.glob: `*` does not cross `/`
        unshipped = [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/")
                                                 for g in globs)]
        assert not unshipped, f"{folder}/: {unshipped} would not be in the wheel: widen package_data in setup.cfg"


def test_a_checkout_reads_its_own_folders():
    assert resources.CHECKOUT == REPO_ROOT
    assert resources.DATA_ROOT == REPO_ROOT
    assert (resources.DS_CONFIG_DIR / "zero0.json").is_file()
    assert (resources.LAUNCHERS_DIR / "slurm" / "smelt.sbatch").is_file()
    assert (resources.RECIPES_DIR / "tiny" / "smelt.yaml").is_file()


def test_licence_and_citation_agree_with_setup_cfg():
    """LICENSE holds the licence setup.cfg declares, and CITATION.cff names the same licence and the
    package's version (a release that bumps one and not the other fails here)."""
    import yaml

    import smelt_ds

    declared = _options()["metadata"]["license"].strip()
    assert declared == "Apache-2.0"
    text = (REPO_ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole licence, not a stub
    cff = yaml.safe_load((REPO_ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0"
    assert cff["license"] == declared
    assert str(cff["version"]) == smelt_ds.__version__
    assert "arXiv:2609.01343" in str(cff["preferred-citation"]["identifiers"])


def _declared_requirements() -> list[str]:
    """install_requires and every extra of setup.cfg, as requirement strings."""
    opts = _options()
    reqs = _lines(opts["options"]["install_requires"])
    for value in opts["options.extras_require"].values():
        reqs += _lines(value)
    return [r for r in reqs if not r.startswith("#")]


def test_constraints_pin_every_declared_requirement_inside_its_range():
    """constraints.txt (the tested set, used by .ci/run) pins every requirement setup.cfg declares,
    at a version inside the declared range: the ranges users install always admit what was tested."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    pins = {}
    for line in _lines((REPO_ROOT / "constraints.txt").read_text()):
        if line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        assert version, f"constraints.txt: {line!r} is not NAME==VERSION"
        pins[canonicalize_name(name)] = Version(version)
    declared = [Requirement(r) for r in _declared_requirements()]
    assert len(declared) >= 15
    for req in declared:
        key = canonicalize_name(req.name)
        assert key in pins, f"constraints.txt does not pin {req.name} (setup.cfg: {req})"
        assert req.specifier.contains(pins[key], prereleases=True), f"{req.name}=={pins[key]} is outside {req}"
