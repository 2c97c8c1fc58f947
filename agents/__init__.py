"""The top layer: PPO training (:mod:`~agents.train`), evaluation against every baseline
(:mod:`~agents.evaluate`, :mod:`~agents.report`, :mod:`~agents.oracle`), the bundled policies
(:mod:`~agents.bundle`) and the end-to-end demo (:mod:`~agents.demo`)."""
