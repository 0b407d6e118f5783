"""``torchao_float8_rowwise``: the strong ``torch_compile`` script with torchao float8 training (recipe
"rowwise") on its decoder linears (:mod:`references.torch_compile.float8`). A bench side only."""

from references.torch_compile.float8 import Float8Engine


class Engine(Float8Engine):
    name = "torchao_float8_rowwise"
    recipe = "rowwise"
    bench_label = "strong torch_compile + torchao float8 (rowwise) on the decoder linears"
