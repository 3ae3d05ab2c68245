"""The cluster: where every process sits (placement), the Ray cluster, the trainer's worker group, start-up.

Ray reads some settings from the environment when it is first imported, so the defaults for a
private local cluster (bound to 127.0.0.1, no token auth) are set here, before any cluster
module imports Ray. A user's own values win.
"""
import os

for _key, _value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                     "RAY_USAGE_STATS_ENABLED": "0"}.items():
    if _key == "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" and os.environ.get("RAY_ADDRESS"):
        continue  # joining a multi-node cluster: leave Ray's default alone
    os.environ.setdefault(_key, _value)
