"""The door between the config and the components: what a checked config implies, built once.

``derived``: facts that need the components' registries (an estimator that needs a critic, ...).
Pure-config facts (cluster shape, devices, the old-log-prob pass) stay in ``megarl.config.derived``.
"""
