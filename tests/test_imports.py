"""models/ and sim/ must run where torch is absent (imports go models <- sim <- runtime)."""

import pkgutil
import subprocess
import sys

import models
import sim


def _modules(package) -> list[str]:
    return [m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")]


def test_models_and_sim_import_without_torch():
    names = ["models", "sim"] + _modules(models) + _modules(sim)
    # Make any attempt to import torch fail loudly, then import every module of both packages.
    code = ("import sys; sys.modules['torch'] = None\n"
            f"import importlib\nfor name in {names!r}: importlib.import_module(name)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
