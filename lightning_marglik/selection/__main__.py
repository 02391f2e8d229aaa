"""``python -m lightning_marglik.selection CONFIG.yaml [overrides]``: the same as ``marglik-select``."""
from .cli import main

main()
