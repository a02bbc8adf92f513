"""``qkv.spec`` was renamed ``qkv.config`` (``qkv.spec.config`` is ``qkv.config.decoder``): the old import paths keep
working for one release, each first import warning with a ``DeprecationWarning`` that names the new path."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = {
    "package": ("import qkv.spec as s, qkv.config as c", "s.DecoderConfig is c.DecoderConfig and s.get_preset is "
                "c.get_preset"),
    "renamed-module": ("from qkv.spec.config import DecoderConfig as D; from qkv.config.decoder import DecoderConfig",
                       "D is DecoderConfig"),
    "module": ("import qkv.spec.presets as p, qkv.config.presets as c", "p is c"),
    "from-package": ("from qkv.spec import hf_config, mixers; import qkv.config.hf_config as h, qkv.config.mixers as m",
                     "hf_config is h and mixers is m"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_old_paths_import_the_new_modules_with_a_deprecation_warning(case):
    statement, check = CASES[case]
    code = ("import warnings\nwith warnings.catch_warnings(record=True) as w:\n    warnings.simplefilter('always')\n"
            f"    {statement}\nassert {check}\n"
            "msgs = [str(x.message) for x in w if x.category is DeprecationWarning]\n"
            "assert any('qkv.spec is renamed qkv.config' in m for m in msgs), msgs\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_new_path_warns_nothing():
    proc = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                           "import qkv, qkv.config, qkv.nn, qkv.costs, qkv.cache, qkv.models"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
