"""The ConfigStore entry hydra/launcher/miles_slurm: the launcher's settings (miles_runner.slurm.settings) plus
Hydra's _target_. (No `from __future__ import annotations`: Hydra's plugin scan runs this module outside
sys.modules, where a dataclass cannot resolve string annotations.)"""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

from miles_runner.slurm.settings import SlurmSettings

LAUNCHER_NAME = "miles_slurm"


@dataclass
class MilesSlurmLauncherConf(SlurmSettings):
    _target_: str = "hydra_plugins.miles_slurm_launcher.launcher.MilesSlurmLauncher"


ConfigStore.instance().store(
    group="hydra/launcher", name=LAUNCHER_NAME, node=MilesSlurmLauncherConf, provider="miles_slurm_launcher"
)
