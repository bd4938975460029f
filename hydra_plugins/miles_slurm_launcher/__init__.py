"""`hydra/launcher=miles_slurm`: miles-run's Slurm launcher (a Hydra Launcher plugin, found by Hydra's plugin scan
of the `hydra_plugins` namespace)."""
