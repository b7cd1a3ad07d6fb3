"""Kubernetes jobs are self-contained: the rendered manifest validates against the Kubernetes API's
JSON schemas (kubernetes-validate, from the package index) and the Kubeflow PyTorchJob's; it
carries the resolved recipe in a ConfigMap that every pod mounts and trains, so a recipe outside
the checkout (with an absolute ``base:``) runs with the stock image; and a recipe path no pod could
open is refused at render time, naming it and the pod's mounts."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from smelt_ds.config.loading import config_to_dict, load_config
from smelt_ds.errors import ConfigError
from smelt_ds.launch.jobs import JobOptions, plan_job, render
from smelt_ds.launch.k8s_mounts import K8S_RECIPE
from smelt_ds.study.recipes import shipped_recipes

ROOT = Path(__file__).resolve().parents[2]
#: the Kubernetes version the manifests are checked against (kubernetes-validate's schemas)
K8S_VERSION = "1.30.0"

_REPLICA = {
    "type": "object", "additionalProperties": False, "required": ["replicas", "restartPolicy", "template"],
    "properties": {"replicas": {"type": "integer", "minimum": 1},
                   "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
                   "template": {"type": "object"}},
}
#: RunPolicy.schedulingPolicy (gang scheduling: Volcano, scheduler-plugins), from the same CRD's SchedulingPolicy
_SCHEDULING_POLICY = {
    "type": "object", "additionalProperties": False,
    "properties": {"minAvailable": {"type": "integer", "minimum": 1}, "queue": {"type": "string"},
                   "priorityClass": {"type": "string"}, "scheduleTimeoutSeconds": {"type": "integer"},
                   "minResources": {"type": "object", "additionalProperties": {"type": ["string", "integer"]}}},
}
#: the PyTorchJob (kubeflow.org/v1) fields the manifest uses, written from the training-operator's
#: CRD (manifests/base/crds/kubeflow.org_pytorchjobs.yaml: PyTorchJobSpec, RunPolicy, ReplicaSpec):
#: unknown fields are refused, as `kubectl apply --validate=strict` refuses them; each replica's pod
#: template is checked with the Kubernetes schema of a PodTemplateSpec (below)
PYTORCHJOB_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"}, "kind": {"const": "PyTorchJob"},
        "metadata": {"type": "object", "required": ["name", "namespace"],
                     "properties": {"name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                             "maxLength": 52},
                                    "namespace": {"type": "string"},
                                    "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["pytorchReplicaSpecs"],
                 "properties": {
                     "runPolicy": {"type": "object", "additionalProperties": False,
                                   "properties": {"backoffLimit": {"type": "integer", "minimum": 0},
                                                  "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                                                  "schedulingPolicy": _SCHEDULING_POLICY}},
                     "pytorchReplicaSpecs": {"type": "object", "additionalProperties": False, "required": ["Master"],
                                             "properties": {"Master": _REPLICA, "Worker": _REPLICA}}}},
    },
}


def validate_manifest(text: str) -> list[dict]:
    """The documents of a rendered manifest, each validated: the ConfigMap against Kubernetes'
    schema, the PyTorchJob against :data:`PYTORCHJOB_SCHEMA` and each of its pod templates against
    Kubernetes' PodTemplate schema (strict: unknown fields are errors). Raises on the first error."""
    docs = list(yaml.safe_load_all(text))
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            jsonschema.validate(doc, PYTORCHJOB_SCHEMA)
            for role, spec in doc["spec"]["pytorchReplicaSpecs"].items():
                pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{role.lower()}"},
                       "template": spec["template"]}
                kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
                (container,) = spec["template"]["spec"]["containers"]
                assert container["name"] == "pytorch"  # the operator finds the container by this name
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    return docs


@pytest.mark.parametrize("entry", shipped_recipes(), ids=lambda e: f"{e.size}/{e.variant}")
def test_every_shipped_recipes_manifest_validates(entry):
    docs = validate_manifest(render(plan_job(entry.path, JobOptions(scheduler="k8s"))))
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]


def test_the_validation_catches_a_broken_manifest():
    """Each schema refuses what it should: a misspelled pod field, a bad restart policy, a ConfigMap
    value that is not a string."""
    text = render(plan_job(ROOT / "recipes/m/smelt.yaml", JobOptions(scheduler="k8s")))
    cm, job = yaml.safe_load_all(text)
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kubernetes_validate.ValidationError, match="volumeMount"):
        validate_manifest(yaml.safe_dump_all([cm, bad]))
    bad = copy.deepcopy(job)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError, match="Sometimes"):
        validate_manifest(yaml.safe_dump_all([cm, bad]))
    bad = copy.deepcopy(cm)
    bad["data"]["recipe.yaml"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_manifest(yaml.safe_dump_all([bad, job]))


def test_a_recipe_outside_the_checkout_travels_in_the_configmap(tmp_path):
    """A recipe in the user's directory with an absolute ``base:`` and a --set: the pods train the
    ConfigMap's copy (the recipe as render-job resolved it), which names nothing of this machine."""
    recipe = tmp_path / "m-smelt-pile.yaml"
    recipe.write_text(yaml.safe_dump({
        "base": str(ROOT / "recipes" / "m" / "smelt.yaml"), "name": "m-smelt-pile",
        "data": {"sources": [{"megatron": "corpora/pile/pile_text_document", "domain": "web"}],
                 "tokenizer": {"path": "corpora/tokenizers/gpt-neox-20b"}}}))
    plan = plan_job(recipe, JobOptions(scheduler="k8s", overrides=["train.lr=0.0002"]))
    text = render(plan)
    cm, job = validate_manifest(text)
    assert str(tmp_path) not in text  # the pods never need this machine's paths
    shipped = tmp_path / "from-configmap.yaml"
    shipped.write_text(cm["data"]["recipe.yaml"])
    resolved = load_config(shipped)
    assert config_to_dict(resolved) == config_to_dict(plan.config) == config_to_dict(
        load_config(recipe, ["train.micro_batch_size=2", "train.lr=0.0002"]))  # the layout's override, then --set
    assert resolved.train.lr == 0.0002
    spec = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    (container,) = spec["containers"]
    assert f'-m smelt_ds.train "${{SMELT_RECIPE:-{K8S_RECIPE}}}" --resume auto' in container["args"][0]
    assert "--set" not in container["args"][0]  # the overrides are in the ConfigMap's recipe
    mount = next(m for m in container["volumeMounts"] if m["name"] == "recipe")
    volume = next(v for v in spec["volumes"] if v["name"] == "recipe")
    assert K8S_RECIPE == f"{mount['mountPath']}/recipe.yaml" and mount["readOnly"]
    assert volume["configMap"]["name"] == cm["metadata"]["name"] == f"{plan.job_name}-recipe"


@pytest.mark.parametrize("sets,refused", [
    (["data.sources=[{megatron: /shared/data/pile/pile_text_document}]", "data.tokenizer.path=corpora/tok.json"],
     r"`data.sources\[0\].megatron` \('/shared/data/pile/pile_text_document', .*\) is in no volume of the pod"),
    (["data.tokenizer.path=/home/me/tokenizer.json"], r"`data.tokenizer.path` \('/home/me/tokenizer.json'"),
    (["train.init_from=exports/tiny"], r"`train.init_from` \('exports/tiny', /workspace/smelt-ds/exports/tiny"),
    (["data.cache_dir=/scratch/cache"], r"`data.cache_dir` \('/scratch/cache'.*leave data.cache_dir unset"),
    (["train.run_dir=/scratch/runs/{name}"], r"`train.run_dir` \('/scratch/runs/tiny-smelt'.*under runs/"),
    (["data.output_dir=/shared/out"], r"`data.output_dir` \('/shared/out'.*leave data.output_dir unset"),
])
def test_a_path_no_pod_can_open_is_refused_naming_it_and_the_mounts(sets, refused):
    plan = plan_job(ROOT / "recipes/tiny/smelt.yaml", JobOptions(scheduler="k8s", nodes=1, gpus_per_node=1,
                                                                 overrides=sets))
    with pytest.raises(ConfigError, match=refused) as e:
        render(plan)
    assert re.search(r"the pod sees: /workspace/smelt-ds/runs \(PVC smelt-runs, shared, read-write\); "
                     r"/workspace/smelt-ds/corpora \(PVC smelt-corpora, read-only\)", str(e.value))


def test_paths_the_pod_sees_pass():
    """Data on the corpora volume, a cache and run directory on the runs volume, a file the image's
    checkout ships (the built-in corpus needs none)."""
    sets = ["data.sources=[{path: corpora/web}, {path: tests/data/corpora/tinyshakespeare-head.txt}]",
            "data.cache_dir=runs/.cache/mine", "train.run_dir=runs/{name}-k8s", "train.init_from=runs/exports/x"]
    plan = plan_job(ROOT / "recipes/tiny/smelt.yaml", JobOptions(scheduler="k8s", nodes=1, gpus_per_node=1,
                                                                 overrides=sets))
    validate_manifest(render(plan))
