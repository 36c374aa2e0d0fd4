"""RULER's synthetic tasks (hsiehjackson/RULER), generated and scored as its own scripts do: ``generate.py``."""
