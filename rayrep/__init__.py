"""rayrep: Ray-native RL of LLM reasoning with verifiable rewards and experience replay."""

__version__ = "0.1.0"
