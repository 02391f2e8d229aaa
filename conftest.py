"""Collection of the package's doctests (``testpaths`` includes ``lightning_marglik``)."""
import importlib.util

# lightning_marglik.lightning needs the optional `lightning` package; its tests skip without it
collect_ignore = [] if importlib.util.find_spec("lightning") else ["lightning_marglik/lightning.py"]
