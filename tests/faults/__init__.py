"""The randomized fault test's tool. ``randomized.py`` is its entry point; its docstring states the
oracle's rules and names the part each module plays."""
