"""``python -m forgetrain [hydra overrides]``: train the forged engine of ``scenario`` (default llama_tiny_cpu)."""

from forgetrain.cli import main

if __name__ == "__main__":
    main()
