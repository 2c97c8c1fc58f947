"""specdepth controller: protocol, Featurizer, service, traces and the `controller` CLI."""
