"""Named configs shipped with the package: `tiny-cpu` (the default) and the papers' presets."""
