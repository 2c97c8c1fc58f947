"""specdepth's controller package: the shared base every layer builds on, the policies, the
service, and the ``controller`` command.

- shared base: :mod:`~controller.errors`, :mod:`~controller._jit`, :mod:`~controller.cpus`,
  :mod:`~controller.protocol` (the wire schema and the one ``Step`` record),
  :mod:`~controller.features` (the Featurizer), :mod:`~controller.policy` (the policy
  interface and its optional capabilities), :mod:`~controller.traces` (the trace format);
- policies: :mod:`~controller.baselines` (the builtins), :mod:`~controller.ppo_policy`
  (PPO zips, the one MLP forward pass), :mod:`~controller.registry` (policy specs);
- the service: :mod:`~controller.service`, :mod:`~controller.polling`, :mod:`~controller.metrics`;
- :mod:`~controller.cli`, the top: one subcommand per job, from every package.

Who may import whom is written down, and checked, in ``tests/test_layering.py``.
"""
