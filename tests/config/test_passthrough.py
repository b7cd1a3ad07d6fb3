"""One value per DeepSpeed setting: a ``deepspeed.config`` key that a recipe field owns is refused at
load time, naming the field, so ``smelt-ds memory``, ``render-job``, the checkpoint layout and the
engine can never read one value while DeepSpeed runs another (the pass-through is merged last)."""

from __future__ import annotations

from pathlib import Path

import pytest

from smelt_ds.cli import main as cli_main
from smelt_ds.config.deepspeed_section import OWNED_KEYS
from smelt_ds.config.loading import config_from_dict
from smelt_ds.errors import ConfigError
from smelt_ds.parallel.ds_config import build_ds_config

ROOT = Path(__file__).resolve().parents[2]

# every owned key (written out here, not read from the table), a value, and the field named instead
CASES = [
    (("zero_optimization", "stage"), 0, "deepspeed.zero_stage"),
    (("zero_optimization", "offload_optimizer", "device"), "cpu", "deepspeed.offload_optimizer"),
    (("zero_optimization", "offload_param", "device"), "cpu", "deepspeed.offload_param"),
    (("zero_optimization", "cpu_offload"), True, "deepspeed.offload_optimizer"),  # DeepSpeed's legacy names
    (("zero_optimization", "cpu_offload_param"), True, "deepspeed.offload_param"),
    (("train_micro_batch_size_per_gpu",), 4, "train.micro_batch_size"),
    (("gradient_accumulation_steps",), 2, "train.gradient_accumulation_steps"),
    (("train_batch_size",), 16, "train.global_batch_tokens"),
    (("gradient_clipping",), 0.5, "train.grad_clip"),
    (("bf16",), {"enabled": True}, "train.precision"),
    (("bfloat16",), {"enabled": True}, "train.precision"),
    (("torch_autocast",), {"enabled": True}, "train.precision"),
    (("fp16",), {"enabled": True}, "train.precision"),
    (("expert_parallel",), {"enabled": True, "autoep_size": 2}, "moe_runtime.backend"),
    (("comms_logger", "enabled"), True, "deepspeed.comms_logger"),
    (("optimizer",), {"type": "Adam", "params": {"lr": 1e-3}}, "train.lr"),
    (("scheduler",), {"type": "WarmupLR"}, "train.schedule"),
]


def _nested(path: tuple[str, ...], value) -> dict:
    out = value
    for key in reversed(path):
        out = {key: out}
    return out


def _raw(**deepspeed) -> dict:
    return {"name": "pt", "model": {"vocab_size": 256, "hidden_size": 32, "num_layers": 4, "num_heads": 4,
                                    "num_kv_heads": 2, "max_seq_len": 32},
            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_size": 16}, "loop": {"position": "middle"},
            "train": {"seq_len": 16, "micro_batch_size": 2, "precision": "fp32"}, "deepspeed": deepspeed}


def test_every_owned_key_has_a_case():
    assert sorted(p for p, _, _ in CASES) == sorted(OWNED_KEYS)


@pytest.mark.parametrize("path,value,field", CASES, ids=[".".join(c[0]) for c in CASES])
def test_an_owned_key_is_refused_naming_the_field(path, value, field):
    with pytest.raises(ConfigError) as info:
        config_from_dict(_raw(zero_stage=3, config=_nested(path, value)))
    msg = str(info.value)
    assert f"`deepspeed.config.{'.'.join(path)}` ({value!r}) is set by the recipe field {field}" in msg, msg
    assert "remove it from deepspeed.config" in msg


def test_the_fields_own_what_deepspeed_reads():
    """Each owned key the DeepSpeed config holds comes from its field (fp16 and scheduler are
    never written: smelt-ds trains in fp32/bf16 and steps its own LR schedule)."""
    cfg = config_from_dict({**_raw(zero_stage=3, offload_optimizer="cpu", offload_param="cpu", comms_logger=True),
                            "moe_runtime": {"backend": "autoep", "ep_size": 2}})
    ds = build_ds_config(cfg, 2)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 1
    assert ds["train_batch_size"] == 4 and ds["gradient_clipping"] == cfg.train.grad_clip
    assert ds["bf16"] == {"enabled": False} and ds["expert_parallel"]["autoep_size"] == 2
    assert ds["comms_logger"]["enabled"] is True and ds["optimizer"]["params"]["lr"] == cfg.train.lr
    assert not {"fp16", "scheduler", "bfloat16", "torch_autocast"} & set(ds)
    assert not {"cpu_offload", "cpu_offload_param"} & set(ds["zero_optimization"])


def test_keys_next_to_owned_ones_pass_through():
    """Tuning keys (bucket sizes, pinned offload buffers, comms logger verbosity) stay the user's."""
    extra = {"zero_optimization": {"reduce_bucket_size": 777, "offload_optimizer": {"pin_memory": False}},
             "comms_logger": {"verbose": True}}
    cfg = config_from_dict(_raw(zero_stage=3, offload_optimizer="cpu", config=extra))
    ds = build_ds_config(cfg, 1)
    assert ds["zero_optimization"]["reduce_bucket_size"] == 777
    assert ds["zero_optimization"]["offload_optimizer"] == {**ds["zero_optimization"]["offload_optimizer"],
                                                            "device": "cpu", "pin_memory": False}
    assert ds["comms_logger"]["verbose"] is True


@pytest.mark.parametrize("command", [["memory"], ["render-job", "--scheduler", "slurm", "--nodes", "4",
                                                  "--gpus-per-node", "8", "--dry-run"]])
def test_memory_and_render_job_refuse_the_stage_passed_through(command, capsys):
    """The issue's case: the stage set under deepspeed.config once made ``memory`` estimate ZeRO-2
    (the field) while DeepSpeed would have run ZeRO-0 (the pass-through)."""
    args = [command[0], str(ROOT / "recipes" / "m" / "smelt.yaml"), *command[1:],
            "--set", "deepspeed.config.zero_optimization.stage=0"]
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "`deepspeed.config.zero_optimization.stage` (0) is set by the recipe field deepspeed.zero_stage" in err
    assert "set deepspeed.zero_stage instead" in err


def test_a_deepspeed_json_key_at_the_section_level_points_to_the_field_and_the_pass_through(capsys):
    """``--set deepspeed.zero_optimization.stage=3`` (DeepSpeed's JSON path, one level too high)
    names ``deepspeed.zero_stage`` and ``deepspeed.config``, not only the allowed keys."""
    assert cli_main(["config", "show", str(ROOT / "recipes" / "tiny" / "smelt.yaml"),
                     "--set", "deepspeed.zero_optimization.stage=3"]) == 2
    err = capsys.readouterr().err
    assert "--set deepspeed.zero_optimization.stage=3: unknown keys in `deepspeed`: ['zero_optimization']" in err
    assert "the ZeRO stage is deepspeed.zero_stage" in err and "go under deepspeed.config" in err


def test_render_job_blames_a_bad_override_on_the_set_not_the_recipe(capsys):
    """render-job names the ``--set`` item a bad value came from, as ``config show`` does."""
    assert cli_main(["render-job", str(ROOT / "recipes" / "tiny" / "smelt.yaml"), "--scheduler", "slurm",
                     "--nodes", "1", "--gpus-per-node", "2", "--set", "moe_runtime.ep_size=3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "error: --set moe_runtime.ep_size=3: `moe_runtime.ep_size` (3) needs an expert-parallel backend" in err
