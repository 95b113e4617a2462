"""Keep secrets (API keys, tokens, passwords) out of logged configs and config dumps.

A value is a secret when its key names one (`api_key`, `wandb_token`, `password`, ...) or when
it equals the value of a secret environment variable (WANDB_API_KEY, HF_TOKEN, ...), whatever
key it sits under. Secret values are replaced by REDACTED; keys are kept so a reader can see that
one was set.
"""

import os
import re
from collections.abc import Collection, Mapping
from typing import Any

REDACTED = "<redacted>"

# "hf_token" and "access_token" are secrets; "pad_token", "tokens_per_step" and "tokenizer" are not.
SECRET_KEY = re.compile(
    r"api_?key|secret|passw(or)?d|credential|((^|_)(access|auth|api|hf|wandb|github|bearer|refresh)_?|^)token$",
    re.IGNORECASE,
)
SECRET_ENV = re.compile(r"(API_?KEY|TOKEN|SECRET|PASSWORD)$")


def secret_env_values(environ: Mapping[str, str] | None = None) -> set[str]:
    """Values of the environment variables whose names mark them as secrets."""
    environ = os.environ if environ is None else environ
    return {value for name, value in environ.items() if SECRET_ENV.search(name) and len(value) >= 8}


def redact_secrets(obj: Any, secrets: Collection[str] | None = None) -> Any:
    """A copy of a nested dict/list config with secret values replaced by REDACTED."""
    secrets = secret_env_values() if secrets is None else secrets
    if isinstance(obj, dict):
        return {
            key: REDACTED if _is_secret_key(key) and obj[key] else redact_secrets(value, secrets)
            for key, value in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_secrets(value, secrets) for value in obj)
    if isinstance(obj, str):
        for secret in secrets:
            obj = obj.replace(secret, REDACTED)
    return obj


def _is_secret_key(key: object) -> bool:
    return isinstance(key, str) and SECRET_KEY.search(key) is not None
