"""Config files shipped inside the package (read them through `miles_runner.core.paths`, never by path).

`conf` is a symlink to the repository's top-level `conf/` (whose `recipe` is a symlink to `recipes/`), so a
checkout and an editable install read the files in place, and a wheel copies them here as package data.
"""
