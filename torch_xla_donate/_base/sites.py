"""Which line of user code a message blames.

Donations are made, judged and refused deep inside the plugin, torch_xla,
and torch (an operator's dispatch, a torch.compile'd call).  Warnings and
records must point at the user's line: the innermost frame that belongs to
none of these.

>>> site = user_site()
>>> site[0].endswith(".py") or site[0].startswith("<")
True
"""
import sys

__all__ = ["user_site", "user_stacklevel", "is_internal"]

# Frames of these modules are never the user's line: the plugin itself,
# torch_xla (torch_xla.compile calls the function it wraps), torch (the
# dispatcher calls __torch_dispatch__, dynamo calls compiled code) and the
# stdlib wrappers that torch_xla.compile and functools.wraps put in between.
_INTERNAL = ("torch_xla_donate", "torch_xla", "torch", "contextlib", "functools")


def is_internal(frame) -> bool:
    """True for a frame of the plugin, torch_xla, torch or their wrappers.

    >>> class Frame: f_globals = {"__name__": "torch._dynamo.eval_frame"}
    >>> is_internal(Frame), is_internal(type("F", (), {"f_globals": {"__name__": "train"}}))
    (True, False)
    """
    module = frame.f_globals.get("__name__", "")
    return any(module == m or module.startswith(m + ".") for m in _INTERNAL)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by the caller point at
    the user's line."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and is_internal(frame):
        level += 1
        frame = frame.f_back
    return level if frame is not None else 1


def user_site():
    """(file, line) of the innermost frame outside the plugin, torch_xla and
    torch: the line messages about a donation should point at."""
    frame = sys._getframe(1)
    while frame is not None:
        if not is_internal(frame):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "<unknown>", 0
