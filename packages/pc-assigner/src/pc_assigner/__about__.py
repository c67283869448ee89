"""Version of the pc-assigner distribution (read by hatchling)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
