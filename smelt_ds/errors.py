"""The one exception type for bad configuration and bad input files.

Every message names the field path (or file), the offending value, and the fix, e.g.::

    `moe.top_k` (9) must be <= `moe.num_experts` (8): lower moe.top_k or raise moe.num_experts.

`ConfigError` deliberately does not derive from `ValueError`: pydantic wraps `ValueError` raised in
validators into its own `ValidationError`, which would lose the field path we already wrote.
"""


from typing import Any, NoReturn


class ConfigError(Exception):
    """Bad configuration or bad input (recipe field, CLI flag, data file)."""


def fail(path: str, value: Any, rule: str, fix: str) -> NoReturn:
    """Raise the one message shape of a bad field: ```path` (value) rule: fix``."""
    raise ConfigError(f"`{path}` ({value!r}) {rule}: {fix}")
