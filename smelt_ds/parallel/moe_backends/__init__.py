"""MoE backends: run the reference MoE layers of a built :class:`SmeltLM` through DeepSpeed.

The model package never imports DeepSpeed; this module does and is applied from outside, like
torchtitan's ``parallelize.py``. One recipe field, ``moe_runtime.backend``, picks how the same reference
layout (``mlp.gate.weight [E, H]``, ``mlp.experts.gate_up_proj [E, 2F, H]``,
``mlp.experts.down_proj [E, H, F]``, optional ``mlp.shared_expert`` + ``mlp.shared_expert_gate``)
runs:

==========  =======================================================  ======  ========================
backend     what runs                                                ZeRO    expert parallel
==========  =======================================================  ======  ========================
reference   ``smelt_ds.model.moe.MoE`` (dropless, plain PyTorch)     0-3     no
deepspeed   :class:`DeepSpeedMoE` around ``deepspeed.moe.layer.MoE``  0-2     ``moe_runtime.ep_size``
autoep      DeepSpeed AutoEP replaces ``layers.{i}.mlp`` in           0-3     ``autoep_size =
            ``deepspeed.initialize`` (``expert_parallel`` section)            moe_runtime.ep_size``
==========  =======================================================  ======  ========================

How the engine uses it (:func:`smelt_ds.parallel.engine.initialize`, :func:`smelt_ds.train.build.build`; all
ranks, same order): after ``deepspeed.init_distributed`` and ``SmeltLM(cfg.model, cfg.moe, cfg.loop)``,
:func:`apply_backend` converts the model (before ``deepspeed.initialize``; raises ConfigError);
:func:`smelt_ds.parallel.ds_config.build_ds_config` adds the ``expert_parallel`` section for
``autoep``; :func:`optimizer_param_groups` splits expert parameters into ``moe`` groups for
``deepspeed``; and ``deepspeed.initialize`` gets ``optimizer=moe_optimizer(torch.optim.AdamW,
...)``, a factory DeepSpeed calls after AutoEP has replaced the layers.

Every backend leaves the same unweighted ``out.aux_loss`` / ``out.z_loss`` (means over MoE *visits*,
the reference definitions), which :func:`smelt_ds.train.objective.total_loss` weights, so the
training loop does not change with the backend.
Checkpoints of every backend also carry the weights in the reference layout
(:mod:`smelt_ds.runs.reference_weights`).

Modules: :mod:`~smelt_ds.parallel.moe_backends.apply` (:func:`apply_backend`, the runtime
checks), :mod:`~smelt_ds.parallel.moe_backends.deepspeed_moe` (the ``deepspeed`` backend),
:mod:`~smelt_ds.parallel.moe_backends.autoep` (the ``autoep`` backend's hooks),
:mod:`~smelt_ds.parallel.moe_backends.expert_parallel` (the MoE blocks of a model, DeepSpeed's
expert-parallel groups) and :mod:`~smelt_ds.parallel.moe_backends.optimizer_groups` (``moe``
optimizer groups). The ``reference`` backend is the model as built: nothing to convert.

What DeepSpeed 0.19.8 does with these layers (gating maths, aux-loss differences, ZeRO and
optimizer-group constraints, AutoEP's limits, checkpoint files) and why the code is as it is:
``docs/deepspeed_notes.md``.
"""

from smelt_ds.parallel.moe_backends.apply import apply_backend, check_backend_runtime
from smelt_ds.parallel.moe_backends.autoep import attach_autoep_hooks, autoep_layers
from smelt_ds.parallel.moe_backends.deepspeed_moe import (
    TUTEL_INSTALL_HINT,
    CapacityRouterOutput,
    DeepSpeedMoE,
    convert_to_deepspeed_moe,
    tutel_available,
)
from smelt_ds.parallel.moe_backends.expert_parallel import expert_parallel_rank
from smelt_ds.parallel.moe_backends.optimizer_groups import (
    moe_optimizer,
    optimizer_param_groups,
    split_params_into_moe_groups,
)

__all__ = ["apply_backend", "check_backend_runtime", "attach_autoep_hooks", "autoep_layers",
           "TUTEL_INSTALL_HINT", "CapacityRouterOutput", "DeepSpeedMoE", "convert_to_deepspeed_moe", "tutel_available",
           "expert_parallel_rank", "moe_optimizer", "optimizer_param_groups", "split_params_into_moe_groups"]
