"""The coordinator service: a tick against the stores, intake of uploads, operator actions, verify."""
