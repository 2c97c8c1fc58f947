"""The SGLang side, loaded inside SGLang's scheduler processes: the plugin (:mod:`~sglang_hook.plugin`),
the actuator (:mod:`~sglang_hook.actuator`), the controller client (:mod:`~sglang_hook.client`),
SGLang's contract (:mod:`~sglang_hook.compat`), the configuration (:mod:`~sglang_hook.config`),
the benchmark profiler (:mod:`~sglang_hook.profiler`) and the launcher
(:mod:`~sglang_hook.launch_server`). It imports nothing but the standard library, pyzmq,
msgpack, numpy, SGLang, and :mod:`controller.protocol`, ``.errors`` and ``.cpus``."""
