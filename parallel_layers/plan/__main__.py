"""`python -m parallel_layers.plan`: the planner's command line (cli.py)."""

from parallel_layers.plan.cli import main

main()
