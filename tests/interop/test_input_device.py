"""The export parity check runs each model on its own device (issue 45): ``smelt-ds export --format
hf`` loads the written directory with ``AutoModelForCausalLM`` and compares its logits with the
source model's; each model reads the fixed batch on its own device
(``to_device(device_of(model), ...)``) and the logits are compared on the CPU.

A CPU-only machine has no second device: the models are put on the emulated one of
:mod:`tests.fake_device` (parameters that say ``meta``, values on the CPU; a CPU batch into such a
model raises "Expected all tensors to be on the same device", as on CUDA). The check must pass with
the same maximum difference as on the CPU, whether both models or only the source are there.
"""

from __future__ import annotations

import pytest

from smelt_ds.parallel.device import device_of
from tests.fake_device import FAKE, fake_device, on_fake_device


@pytest.mark.parametrize("sections,where", [
    ({}, "both"),
    ({}, "source"),
    ({"model": {"num_layers": 6}, "loop": {"position": "none"}}, "both"),
], ids=["smelt-both", "smelt-source-only", "mixtral-both"])
def test_export_parity_check_on_the_model_devices(make_export, tmp_path, monkeypatch, sections, where):
    from transformers import AutoModelForCausalLM

    from smelt_ds.interop import hf_export

    name = f"tiny-dev-{'smelt' if not sections else 'baseline'}"
    src = make_export(name, **sections)
    want = hf_export.export_hf(src, tmp_path / "cpu")

    load_hf = AutoModelForCausalLM.from_pretrained
    real_check = hf_export._check_parity
    placed: list[str] = []

    def check_on_device(out, model, cfg, remote_code):  # the source, written from the CPU, checked there
        on_fake_device(model)
        assert device_of(model) == FAKE
        placed.append("source")
        return real_check(out, model, cfg, remote_code)

    def hf_on_device(*args, **kwargs):
        with mode.suspended():  # transformers loads as it does on the CPU
            model, info = load_hf(*args, **kwargs)
        if where == "both":
            on_fake_device(model)
            assert device_of(model) == FAKE
            placed.append("hf")
        return model, info

    monkeypatch.setattr(hf_export, "_check_parity", check_on_device)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", hf_on_device)
    with fake_device() as mode:
        got = hf_export.export_hf(src, tmp_path / "fake")
    assert placed == (["source", "hf"] if where == "both" else ["source"])
    assert mode.moves == (2 if where == "both" else 1) and not mode.mixed
    assert got.model_type == want.model_type == ("smelt" if not sections else "mixtral")
    assert got.max_abs_diff == want.max_abs_diff and want.max_abs_diff <= 1e-4
