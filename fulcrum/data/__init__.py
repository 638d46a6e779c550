"""Data: GSM8K preprocessing (`gsm8k`, `fulcrum data`), the RL prompt data set (`dataset`), synthetic tasks."""
