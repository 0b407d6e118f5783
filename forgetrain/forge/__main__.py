"""``python -m forgetrain.forge scenario=NAME agent.command="..." [forge.*]``: run the forge loop."""

from forgetrain.forge import main

if __name__ == "__main__":
    main()
