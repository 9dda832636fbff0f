"""The run's configuration: the config tree, its files and its presets.

`ctrflow.config.tree` holds the frozen dataclasses (`TrainConfig` over `DataConfig`, `ModelConfig`,
`OptimConfig`; each model's own settings come from its file, `ctrflow.models`); `ctrflow.config.files`
reads and writes them as YAML or JSON (`--config FILE|PRESET`, `--print-config`) with command-line
overrides; `ctrflow.config.presets` names whole runs, shipped as YAML files in `presets/`.
"""

from ctrflow.config.files import load_config, preset_names, to_yaml
from ctrflow.config.presets import criteo_1tb_config, small_config
from ctrflow.config.tree import CHOICES, DataConfig, ModelConfig, OptimConfig, TrainConfig, choices_of

__all__ = ["CHOICES", "DataConfig", "ModelConfig", "OptimConfig", "TrainConfig", "choices_of", "criteo_1tb_config",
           "load_config", "preset_names", "small_config", "to_yaml"]
