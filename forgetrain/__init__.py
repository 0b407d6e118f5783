"""ForgeTrain: per-scenario forged training engines, proven against Megatron-core tier by tier."""

__version__ = "0.1.0"
