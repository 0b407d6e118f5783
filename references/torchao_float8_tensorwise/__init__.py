"""torchao float8 (tensorwise) on the strong torch_compile script's decoder linears (references/torch_compile)."""
