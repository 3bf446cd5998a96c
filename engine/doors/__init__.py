"""The front doors: the command line (cli.py, run as `python -m engine.run`), the Python API
(api.py, imported as `from engine.api import Engine`) and the one wiring both share
(session.py: check, knobs -> policy -> decode; loading is fast/paths.py's).

Skip this folder to learn the algorithms.
"""
