"""torchao float8 (rowwise) on the strong torch_compile script's decoder linears (references/torch_compile)."""
