"""`python -m graphxform`: the graphxform command."""

from graphxform.cli import console_main

console_main()
