"""``python -m forgetrain [hydra overrides]``: train the forged engine of ``scenario`` (default llama_tiny_cpu).

Prepares the data (the embedded Shakespeare corpus unless ``data.*`` says otherwise), trains for ``train.steps``
optimizer steps with a progress bar, and writes into ``train.out_dir`` (default outputs/<scenario>/<date>_<time>):
the per-step trace (trace/), checkpoints (checkpoints/; continue with train.resume=true), summary.json, loss.png
and the composed config (.hydra/config.yaml). Bad input is one ``error:`` line, exit 2, and writes nothing.
"""

from forgetrain.cli import main

if __name__ == "__main__":
    main()
