"""Training recipes of the shipped draft model and EAGLE head (not part of the specjax package)."""
