"""`from engine.api import Engine`: the engine from Python, whose code is engine/doors/api.py."""
from engine.doors.api import Engine

__all__ = ["Engine"]
