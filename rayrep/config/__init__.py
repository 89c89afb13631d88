"""Typed configuration: the schema (`schema`), where a Config comes from (`loading`), and
the field machinery both use (`fields`)."""

from rayrep.config.loading import (DEFAULT_PRESET, config_fields, differing_fields, from_dict, help_text, load_preset,
                                   parse_cli, preset_names)
from rayrep.config.schema import (AlgorithmConfig, Config, CorrectionConfig, DataConfig, ExGRPOConfig, GeneratorConfig,
                                  LearnerConfig, LoggingConfig, ModelConfig, PlacementConfig, ReplayConfig, RLEPConfig,
                                  RunConfig, ServeConfig, SyncConfig, VerifierConfig, derive_seed)
from rayrep.errors import ConfigError, InputError

__all__ = [
    "DEFAULT_PRESET", "AlgorithmConfig", "Config", "ConfigError", "CorrectionConfig", "DataConfig", "ExGRPOConfig",
    "GeneratorConfig", "InputError", "LearnerConfig", "LoggingConfig", "ModelConfig", "PlacementConfig", "RLEPConfig",
    "ReplayConfig", "RunConfig", "ServeConfig", "SyncConfig", "VerifierConfig", "config_fields", "derive_seed",
    "differing_fields", "from_dict", "help_text", "load_preset", "parse_cli", "preset_names",
]
