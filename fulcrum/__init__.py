"""fulcrum: reinforcement-learning post-training (PPO, GRPO and kin) for large language models."""

__version__ = "0.1.0"
