"""Hugging Face transformers format: export SMELT and Baselines, import transformers MoE checkpoints.

State-dict adapters tested by parity (docs/huggingface.md): a converted model's logits equal the source's.
Commands: ``smelt-ds export`` (both formats) and ``smelt-ds import-hf`` (:mod:`smelt_ds.interop.cli`).
"""
