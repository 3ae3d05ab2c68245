"""verl's entry point with ``verl`` replaced by ``megarl``: ``python -m megarl.trainer.main_ppo [verl's arguments]``.

Takes verl's command line unchanged (``--config-path``, ``--config-name``, Hydra overrides; the
default config is ``ppo_megatron_trainer``) and runs ``megarl.run.train``.
"""
import sys

from megarl.run.train import main

if __name__ == "__main__":
    sys.exit(main())
