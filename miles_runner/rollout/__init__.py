"""Rollout plug-ins: tasks (prompt sources and environments), rewards and agents, named in config.

Only registered names can be selected (``rollout.task``, ``rollout.reward``, ``rollout.agent``); config never
carries an import path. ``miles_runner.plugins.lookup`` resolves names; an unknown one is a ``PluginError``
that lists the registered names. No heavy imports here.
"""
