"""bridge_compat's stand-ins: Megatron-Bridge imports on CPU with Transformer Engine still absent for everyone
else and its HAVE_TE flags false; an untested Bridge version, or one whose stand-in targets moved, fails loudly;
nothing is changed when CUDA is available."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest

from miles_runner.trainer.megatron import bridge_compat


@pytest.fixture(scope="module", autouse=True)
def adapted() -> None:
    bridge_compat.apply_bridge_adaptations()


def test_bridge_imports_with_transformer_engine_still_absent():
    lora_layers = importlib.import_module(bridge_compat.LORA_LAYERS)
    assert isinstance(lora_layers.te, bridge_compat._StandInModule)  # what lora_layers saw while it loaded
    assert bridge_compat.TE_PACKAGE not in sys.modules
    with pytest.raises(ImportError):
        importlib.import_module(bridge_compat.TE_PACKAGE)
    for name in bridge_compat.TE_FLAG_MODULES:
        assert importlib.import_module(name).HAVE_TE is False


def test_applying_twice_changes_nothing():
    finders = list(sys.meta_path)
    bridge_compat.apply_bridge_adaptations()
    assert sys.meta_path == finders


def test_an_untested_bridge_version_is_refused(monkeypatch):
    monkeypatch.setattr(bridge_compat, "megatron_bridge_version", lambda: "0.7.0")
    with pytest.raises(RuntimeError, match=r"megatron-bridge 0\.7\.0 is installed.*tested on 0\.6\.2"):
        bridge_compat.check_version()


def test_a_lost_have_te_flag_fails_loudly(monkeypatch):
    module = importlib.import_module(bridge_compat.TE_FLAG_MODULES[0])
    monkeypatch.delattr(module, "HAVE_TE")
    with pytest.raises(RuntimeError, match=r"peft\.utils\.HAVE_TE no longer exists"):
        bridge_compat.turn_off_te_flags()


def test_a_moved_lora_layers_module_fails_loudly(monkeypatch):
    monkeypatch.setattr(bridge_compat, "LORA_LAYERS_FILE", ("peft", "moved_lora_layers.py"))
    with pytest.raises(RuntimeError, match=r"lora_layers no longer exists"):
        bridge_compat._require_lora_layers_file()


def test_stand_in_classes_match_nothing():
    te = bridge_compat._te_stand_in()["transformer_engine.pytorch"]
    assert isinstance(te.ops, types.ModuleType)
    assert te.ops.Sequential is te.ops.Sequential  # stable, so annotations and isinstance agree
    assert not isinstance(object(), (te.Linear, te.LayerNormLinear))


def test_nothing_changes_when_cuda_is_available():
    probe = (
        "import sys, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "from miles_runner.trainer.megatron import bridge_compat\n"
        "bridge_compat.apply_bridge_adaptations()\n"
        "finder = any(isinstance(f, bridge_compat._LoraLayersFinder) for f in sys.meta_path)\n"
        "print(finder, 'megatron.bridge' in sys.modules, 'megatron.core' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False"]
