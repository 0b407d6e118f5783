"""ForgeTrain's config: the schema (:mod:`.schema`: one dataclass per group, the ``engine.*`` group built from the
engines' lever tables, Hydra registration, the composed config as a :class:`RunConfig`) and the one up-front check
(:mod:`.checks`: :func:`validate`). Every name is importable from here, ``from forgetrain.config import RunConfig,
validate``."""

from forgetrain.config.checks import validate
from forgetrain.config.schema import (SEED_MAX, DataConfig, EngineOptions, HardwareConfig, KernelsConfig,
                                      LoggerConfig, ModelConfig, ParallelConfig, RunConfig, ScenarioConfig,
                                      TrainConfig, check_model_choice, check_scenario_choice, engine_options_class,
                                      grad_accum_steps, inductor_options, register_configs, to_run_config)
from forgetrain.levers import COMPILE_TUNINGS
from forgetrain.memory import per_layer_weights_possible

__all__ = ["COMPILE_TUNINGS", "SEED_MAX", "DataConfig", "EngineOptions", "HardwareConfig", "KernelsConfig",
           "LoggerConfig", "ModelConfig", "ParallelConfig", "RunConfig", "ScenarioConfig", "TrainConfig",
           "check_model_choice", "check_scenario_choice", "engine_options_class", "grad_accum_steps",
           "inductor_options", "per_layer_weights_possible", "register_configs", "to_run_config", "validate"]
