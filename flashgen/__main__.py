"""`python -m flashgen` runs the CLI (handy where the console script is not installed)."""
from .cli import main

main()
