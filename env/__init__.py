"""The simulator: an SGLang EAGLE-3 engine model fitted to traces and profiles.

Importing this package registers the gymnasium environment ``SpecDecode-v0``
(:class:`env.gym_env.SpecDecodeEnv`). Modules: :mod:`env.latency`, :mod:`env.acceptance`,
:mod:`env.workload` (component models), :mod:`env.params` (SimParams), :mod:`env.engine`
(the discrete-event engine), :mod:`env.runner` (the one simulation loop), :mod:`env.fit`
(``fit_sim``), :mod:`env.deployments` (bundled deployments), :mod:`env.errors` (``FitError``),
:mod:`env.cli` (``controller fit`` and ``bench``). Data: ``profiles/`` (the measured latency
profile the fit starts from), ``example_traces/``.
"""

from __future__ import annotations

try:
    from gymnasium.envs.registration import register as _register
    from gymnasium.envs.registration import registry as _registry
except ImportError:  # the hook's lean environment has no gymnasium; the env is not needed there
    _register = None  # type: ignore[assignment]
    _registry = {}

ENV_ID = "SpecDecode-v0"

if _register is not None and ENV_ID not in _registry:
    _register(id=ENV_ID, entry_point="env.gym_env:SpecDecodeEnv", max_episode_steps=2048)
