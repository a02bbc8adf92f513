"""Deprecated: ``qkv.spec`` is now :mod:`qkv.config` (a folder named ``spec`` reads as a test folder to common
tooling, and the name collided with :mod:`qkv.cache.specs`). This module keeps ``import qkv.spec`` and
``from qkv.spec.<module> import ...`` working for one release, with a ``DeprecationWarning``; ``qkv.spec.config`` is
:mod:`qkv.config.decoder`."""

from __future__ import annotations

import importlib
import sys
import warnings

from qkv import config as _config
from qkv.config import *  # noqa: F403 - the old package's public names

warnings.warn("qkv.spec is renamed qkv.config (qkv.spec.config is qkv.config.decoder); the old path goes in the next "
              "release", DeprecationWarning, stacklevel=2)

__all__ = list(_config.__all__)

#: the old submodule names -> the new ones
_MOVED = {"config": "decoder", "config_file": "config_file", "dsa": "dsa", "hf_config": "hf_config",
          "latent": "latent", "layer_types": "layer_types", "linear": "linear", "mixers": "mixers", "moe": "moe",
          "presets": "presets", "rope": "rope"}

for _old, _new in _MOVED.items():
    _module = importlib.import_module(f"qkv.config.{_new}")
    sys.modules[f"{__name__}.{_old}"] = _module
    globals()[_old] = _module
