"""kvhit's exporter: source → snapshot → window → observation → fitters → analysis → collector."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvhit")
except PackageNotFoundError:  # a checkout run without `pip install .`
    __version__ = "unknown"
