"""``python -m forgetrain.forge scenario=NAME agent.command="..." [forge.*]``: run the forge loop.

Each round gives a coding agent (``agent.command``, any CLI that edits files) a brief in a git workspace seeded from
scenarios/NAME/, then judges its engine on the equivalence ladder against ``forge.reference`` and records the
evidence; the engine is sealed once it reaches ``forge.target_tier``. Exit 0 when sealed, 1 otherwise.
Workflow and real agent command lines: docs/forge.md.
"""

from forgetrain.forge import main

if __name__ == "__main__":
    main()
