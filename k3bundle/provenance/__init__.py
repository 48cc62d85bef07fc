"""Checks of a finished bundle, above the converter: ``verify`` re-hashes it and re-derives it from
the source (with the converter itself), ``trace`` explains any device byte by its source bytes."""
